#!/bin/sh
# rendezvous_test.sh TENSORD RENDEZVOUS
#
# Runs examples/rendezvous.c as its header shows: a tensord, then 4 processes at once that take
# ranks with ADD, publish their addresses, meet at a BARRIER, read the table with MGET and meet
# again. Checks that every process exits 0, that rank 0 printed 4 distinct rows and that the
# ranks were 0 to 3; stops the tensord it started.
set -eu
tensord=$1 rdzv=$2
tmp=$(mktemp -d)
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
"$tensord" --port 0 --port-file "$tmp/port" --log-level warn >"$tmp/tensord.log" 2>&1 &
pid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ "$i" -le 150 ] || { echo "rendezvous_test: tensord did not start"; exit 1; }
    sleep 0.1
done
addr="127.0.0.1:$(cat "$tmp/port")"
pids=
for r in 0 1 2 3; do
    "$rdzv" "$addr" 4 job >"$tmp/out.$r" 2>&1 &
    pids="$pids $!"
done
bad=0
for p in $pids; do
    wait "$p" || bad=$((bad + 1))
done
cat "$tmp"/out.*
[ "$bad" -eq 0 ] || { echo "rendezvous_test: $bad processes failed"; exit 1; }
rows=$(cat "$tmp"/out.* | grep -c '^rank [0-3]: ')
[ "$rows" -eq 4 ] || { echo "rendezvous_test: $rows table rows, expected 4"; exit 1; }
pids_seen=$(cat "$tmp"/out.* | grep '^rank [0-3]: ' | sed 's/.* pid //' | sort -u | wc -l)
[ "$pids_seen" -eq 4 ] || { echo "rendezvous_test: $pids_seen distinct processes, expected 4"; exit 1; }
grep -q 'barrier generations 1 and 2' "$tmp"/out.* || { echo "rendezvous_test: no summary"; exit 1; }
echo "rendezvous_test: ok"
