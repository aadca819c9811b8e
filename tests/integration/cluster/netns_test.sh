#!/bin/sh
# netns_test.sh TENSORD CT_NETNS_CLIENT
#
# Three shards on three "hosts" and a client on a fourth, made of Linux network namespaces:
#
#   ts-PID-br   holds the bridge br0 and the bridge ends of the veth pairs (vs0 vs1 vs2 vc)
#   ts-PID-0    shard 0: eth0 10.77.0.10/24, tensord --shard 0/3
#   ts-PID-1    shard 1: eth0 10.77.0.11/24, tensord --shard 1/3
#   ts-PID-2    shard 2: eth0 10.77.0.12/24, tensord --shard 2/3
#   ts-PID-c    the client: eth0 10.77.0.100/24, runs CT_NETNS_CLIENT
#
# The subnet 10.77.0.0/24 exists only inside these namespaces (the bridge is in a namespace of
# its own, not the host's), so it never meets the host's interfaces, routes or addresses, and two
# runs at once cannot collide (the namespace names carry this script's PID). The client checks
# routing, then the script's partition command takes shard 1's bridge port down
# (`ip -n ts-PID-br link set vs1 down`: the shard keeps running, its packets stop: a network
# partition, not a crash) while the client keeps calling every shard; then the link comes back up
# and the client measures the recovery. See ct_netns_client.c for the checks.
#
# The tensords listen on their namespace's address with a token (anything but loopback needs one)
# and on port 0 (each writes its port to a file). Everything is torn down on exit: each process
# stopped by its PID, each namespace this run created deleted. Needs root (CAP_SYS_ADMIN and
# CAP_NET_ADMIN); without it the test says why and fails. About 15 s; bounded at 60 s.
set -u
tensord=$1 client=$2
id=$$
pre="ts-$id"
subnet=10.77.0
tmp=$(mktemp -d)
made_ns=
pids=

log() { echo "netns_test: $*"; }

stop_pid() {
    # SIGTERM, up to 5 s, then SIGKILL; only a PID this script started.
    p=$1
    kill -TERM "$p" 2>/dev/null || return 0
    i=0
    while kill -0 "$p" 2>/dev/null && [ "$i" -lt 50 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
    return 0
}

cleanup() {
    for p in $pids; do
        stop_pid "$p"
    done
    # Deleting a namespace removes the veth ends and the bridge inside it.
    for ns in $made_ns; do
        ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    done
    for f in "$tmp"/tensord*.log; do
        [ -s "$f" ] && { log "--- $f"; cat "$f"; }
    done
    rm -rf "$tmp"
}
trap cleanup EXIT
# A signal (also SIGPIPE from a closed reader of our output) still runs the cleanup.
trap 'exit 1' INT TERM HUP PIPE

add_ns() {
    if ! err=$(ip netns add "$1" 2>&1); then
        log "cannot create network namespace $1: $err"
        log "this test needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; it does not skip"
        exit 1
    fi
    made_ns="$made_ns $1"
}

command -v ip >/dev/null 2>&1 || { log "iproute2's ip is not installed"; exit 1; }
[ -x "$tensord" ] || { log "no tensord at $tensord"; exit 1; }
[ -x "$client" ] || { log "no client program at $client"; exit 1; }

set -e
add_ns "$pre-br"
ip -n "$pre-br" link add br0 type bridge
ip -n "$pre-br" link set br0 up
# host_ns BRIDGE_PORT ADDRESS: a namespace joined to the bridge by a veth pair.
host_ns() {
    ns=$1 port=$2 addr=$3
    add_ns "$ns"
    ip -n "$pre-br" link add "$port" type veth peer name eth0 netns "$ns"
    ip -n "$pre-br" link set "$port" master br0 up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
}
for i in 0 1 2; do
    host_ns "$pre-$i" "vs$i" "$subnet.1$i"
done
host_ns "$pre-c" vc "$subnet.100"
set +e

umask 077
echo "netns-test-token-$id" >"$tmp/token"
for i in 0 1 2; do
    ip netns exec "$pre-$i" "$tensord" --host "$subnet.1$i" --port 0 --port-file "$tmp/port$i" \
        --auth-token-file "$tmp/token" --shard "$i/3" --log-level warn >"$tmp/tensord$i.log" 2>&1 &
    pids="$pids $!"
done
list=
for i in 0 1 2; do
    n=0
    while [ ! -s "$tmp/port$i" ]; do
        n=$((n + 1))
        [ "$n" -le 150 ] || { log "tensord of shard $i did not start within 15 s"; exit 1; }
        sleep 0.1
    done
    list="$list${list:+,}$subnet.1$i:$(cat "$tmp/port$i")"
done
log "shards at $list (namespaces $pre-0..2, client in $pre-c, bridge in $pre-br)"

start=$(date +%s)
TS_AUTH_TOKEN="netns-test-token-$id" timeout -k 5 50 ip netns exec "$pre-c" "$client" "$list" 1 \
    "ip -n $pre-br link set vs1 down" "ip -n $pre-br link set vs1 up"
rc=$?
log "client exited $rc after $(($(date +%s) - start)) s"
# Every shard must still be running: the partition cut the network, it killed nothing.
for p in $pids; do
    kill -0 "$p" 2>/dev/null || { log "tensord $p died during the test"; rc=1; }
done
[ "$rc" -eq 0 ] && log "ok"
exit "$rc"
