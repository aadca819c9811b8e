#!/bin/sh
# The stream example end to end: one tensord, one producer making image batches (32 rows, about
# 1 MiB, real CPU work), and four training consumers reading every batch at their own batch
# sizes (16, 32, 48 and 64 rows):
#   t16, t32  from the start;
#   t48       killed with SIGKILL in the middle of epoch 1 and started again: it resumes after
#             what it had acknowledged (it commits every 3 batches), and the rows it gets again
#             are counted as redelivered;
#   t64       joins late (after epoch 1 is produced) at the oldest entry the stream kept: it
#             replays the window, so its first epoch is partial.
# Then it checks that, for every epoch a consumer saw from its start, the rows and the sum of
# the row hashes equal the producer's, that the restarted consumer got again only rows of its
# uncommitted tail, and that no consumer reported an error.
#
#   examples/stream_demo.sh                       # binaries from ./build
#   examples/stream_demo.sh --build /path/build   # or name the build directory
#   examples/stream_demo.sh --epochs 3 --batches-per-epoch 16 --step-ms 2   # smaller
# TENSORD, STREAM_PRODUCER and STREAM_CONSUMER (paths) override the binaries. Exit status 0 when
# every check passed. Everything it starts is stopped on exit; --keep keeps the logs.
set -eu

build=build
epochs=4
bpe=24
step_ms=4
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --batches-per-epoch) bpe=$2; shift 2 ;;
    --step-ms) step_ms=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help)
        sed -n '2,22p' "$0"
        exit 0
        ;;
    *) echo "stream_demo: unknown argument $1" >&2; exit 2 ;;
    esac
done
tensord=${TENSORD:-$build/server/tensord}
producer=${STREAM_PRODUCER:-$build/examples/stream_producer}
consumer=${STREAM_CONSUMER:-$build/examples/stream_consumer}
for b in "$tensord" "$producer" "$consumer"; do
    [ -x "$b" ] || { echo "stream_demo: $b is missing (build it, or pass --build)" >&2; exit 2; }
done
if [ "$epochs" -lt 3 ]; then
    echo "stream_demo: --epochs must be at least 3 (the late consumer joins after epoch 1)" >&2
    exit 2
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ts-stream-demo.XXXXXX")
pids=""
tsd=""
cleanup() {
    for p in $pids; do
        kill "$p" 2>/dev/null || true
    done
    if [ -n "$tsd" ]; then
        kill "$tsd" 2>/dev/null || true
        wait "$tsd" 2>/dev/null || true
    fi
    if [ "$keep" = 1 ]; then
        echo "stream_demo: logs kept in $tmp"
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
    echo "stream_demo: FAILED: $*"
    for f in "$tmp"/*.log; do
        echo "== $f"
        cat "$f"
    done
    exit 1
}

"$tensord" --port 0 --port-file "$tmp/port" --log-level warn >"$tmp/tensord.log" 2>&1 &
tsd=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ $i -le 1500 ] || fail "tensord did not start"
    sleep 0.01
done
addr="127.0.0.1:$(cat "$tmp/port")"
echo "stream_demo: tensord at $addr, logs in $tmp"

# The replay window (one and a half epochs) holds less than two epochs, so the late consumer
# finds epoch 0 partly gone; the credit window keeps live consumers at most a third of an epoch
# (16 entries at most) behind. The producer starts making batches once the first three
# consumers have joined.
replay=$((bpe * 3 / 2 + 1))
window=$((bpe / 3))
[ $window -le 16 ] || window=16
[ $window -ge 1 ] || window=1
common="--address $addr --name images --epochs $epochs --timeout-s 60"
"$producer" --address "$addr" --name images --fresh --epochs "$epochs" \
    --batches-per-epoch "$bpe" --rows 32 --max-entries $replay --window $window --lease-ms 5000 \
    --wait-consumers 3 \
    >"$tmp/producer.log" 2>&1 &
ppid_=$!
pids="$pids $ppid_"
# shellcheck disable=SC2086
"$consumer" $common --group t16 --batch-rows 16 --step-ms "$step_ms" >"$tmp/t16.log" 2>&1 &
c16=$!
# shellcheck disable=SC2086
"$consumer" $common --group t32 --batch-rows 32 --step-ms "$step_ms" >"$tmp/t32.log" 2>&1 &
c32=$!
# shellcheck disable=SC2086
"$consumer" $common --group t48 --batch-rows 48 --step-ms $((step_ms * 2)) --commit-every 3 \
    --state "$tmp/t48.state" >"$tmp/t48-first.log" 2>&1 &
c48=$!
pids="$pids $c16 $c32 $c48"

# Batches t48 has on record in its state log.
batches_of_t48() {
    if [ -f "$tmp/t48.state" ]; then
        grep -c '^b' "$tmp/t48.state" || true
    else
        echo 0
    fi
}
# Kill t48 in the middle of epoch 1: each epoch is bpe*32/48 of its batches.
per_epoch=$((bpe * 32 / 48))
kill_at=$((per_epoch + per_epoch / 2 + 1))
i=0
while [ "$(batches_of_t48)" -lt "$kill_at" ]; do
    i=$((i + 1))
    [ $i -le 6000 ] || fail "t48 did not get $kill_at batches"
    kill -0 "$c48" 2>/dev/null || fail "t48 ended early"
    sleep 0.01
done
kill -KILL "$c48"
wait "$c48" 2>/dev/null || true
echo "stream_demo: killed t48 (SIGKILL) after $(batches_of_t48) batches"
sleep 0.3
# shellcheck disable=SC2086
"$consumer" $common --group t48 --batch-rows 48 --step-ms $((step_ms * 2)) --commit-every 3 \
    --state "$tmp/t48.state" >"$tmp/t48.log" 2>&1 &
c48=$!
pids="$pids $c48"

# t64 joins once epoch 1 is produced, at the oldest entry kept.
i=0
while ! grep -q '^producer: epoch 1:' "$tmp/producer.log"; do
    i=$((i + 1))
    [ $i -le 6000 ] || fail "the producer did not finish epoch 1"
    sleep 0.01
done
# shellcheck disable=SC2086
"$consumer" $common --group t64 --batch-rows 64 --start oldest --step-ms "$step_ms" \
    >"$tmp/t64.log" 2>&1 &
c64=$!
pids="$pids $c64"
echo "stream_demo: t64 joined late"

wait "$ppid_" || fail "the producer failed"
for c in t16:$c16 t32:$c32 t48:$c48 t64:$c64; do
    wait "${c#*:}" || fail "consumer ${c%%:*} failed"
done
pids=""

# The checks: each consumer's complete epochs against the producer's.
for g in t16 t32 t48 t64; do
    grep -q "^consumer $g: done: .* 0 errors$" "$tmp/$g.log" || fail "$g reported errors"
    complete=0
    e=0
    while [ $e -lt "$epochs" ]; do
        want=$(sed -n "s/^producer: epoch $e: rows \([0-9]*\), .*hash \([0-9a-f]*\)$/\1 \2/p" \
            "$tmp/producer.log")
        [ -n "$want" ] || fail "the producer did not report epoch $e"
        got=$(sed -n "s/^consumer $g: epoch $e: rows \([0-9]*\), .*hash \([0-9a-f]*\)$/\1 \2/p" \
            "$tmp/$g.log")
        if [ -z "$got" ] && [ "$g" = t64 ] && [ $complete = 0 ]; then
            : # The late consumer joined after this epoch had left the window.
        elif grep -q "^consumer $g: epoch $e: .*partial$" "$tmp/$g.log"; then
            # Only the late consumer may start in the middle, and only before its first whole
            # epoch.
            [ "$g" = t64 ] && [ $complete = 0 ] || fail "$g: epoch $e partial"
        else
            [ "$got" = "$want" ] || fail "$g: epoch $e: got rows/hash '$got', produced '$want'"
            complete=$((complete + 1))
        fi
        e=$((e + 1))
    done
    # The late consumer's first whole epoch depends on how far the producer had gone when it
    # joined (at most the window ahead of the slowest consumer): at least the last one.
    need=$epochs
    [ "$g" != t64 ] || need=1
    [ $complete -ge $need ] || fail "$g: only $complete whole epochs"
done
line=$(grep "^consumer t48: resumed:" "$tmp/t48.log") || fail "t48 did not resume"
red=$(echo "$line" | sed -n 's/.* \([0-9]*\) acknowledged), \([0-9]*\) rows received after it, \([0-9]*\) rows redelivered (at most \([0-9]*\),.*/\1 \2 \3 \4/p')
[ -n "$red" ] || fail "t48: unexpected resume line: $line"
# shellcheck disable=SC2086
set -- $red
total=$(sed -n 's/^producer: done: .* epochs, \([0-9]*\) rows,.*/\1/p' "$tmp/producer.log")
[ $(($1 + $2)) = "$total" ] ||
    fail "t48: $1 rows acknowledged before the restart + $2 after it != $total produced"
[ "$3" -le "$4" ] || fail "t48: $3 rows redelivered, more than its uncommitted tail $4"
set -- "$3" "$4"

echo
grep -h "^producer: epoch\|^producer: done" "$tmp/producer.log"
for g in t16 t32 t48 t64; do
    grep -h "^consumer $g: \(epoch\|resumed\|done\)" "$tmp/$g.log"
done
echo "stream_demo: ok: every whole epoch of every consumer matches the producer's rows and" \
    "hashes; t48 resumed after SIGKILL with $1 rows redelivered (uncommitted tail $2)"
