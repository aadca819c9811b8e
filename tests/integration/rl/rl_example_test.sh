#!/bin/sh
# rl_example_test.sh TENSORD RL_TRAINER RL_WORKER
#
# Runs docs/RL.md's example as written (a trainer and two workers as separate processes against
# one tensord, smaller counts) and checks that the trainer finished its iterations and each
# worker had all its rollouts stored. Everything started is stopped on exit.
set -eu
tensord=$1
trainer=$2
worker=$3

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ts-rl-example.XXXXXX")
pid=""
cleanup() {
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM
fail() {
    echo "rl_example_test: $*"
    for f in "$tmp"/*.log; do
        echo "== $f"
        cat "$f"
    done
    exit 1
}

"$tensord" --port 0 --port-file "$tmp/port" --log-level warn &
pid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ $i -le 1500 ] || fail "tensord did not start"
    sleep 0.01
done
addr="127.0.0.1:$(cat "$tmp/port")"

timeout 120 "$trainer" --address "$addr" --iterations 8 --wait-s 30 >"$tmp/trainer.log" 2>&1 &
tpid=$!
timeout 120 "$worker" --address "$addr" --id 1 --rollouts 100 --wait-s 30 >"$tmp/w1.log" 2>&1 &
w1=$!
timeout 120 "$worker" --address "$addr" --id 2 --rollouts 100 --wait-s 30 >"$tmp/w2.log" 2>&1 ||
    fail "worker 2 failed"
wait $w1 || fail "worker 1 failed"
wait $tpid || fail "the trainer failed"

grep -q "^iteration 7 " "$tmp/trainer.log" || fail "the trainer did not run 8 iterations"
grep -q "^trainer: version 8, 128 items received" "$tmp/trainer.log" ||
    fail "unexpected trainer summary"
for w in 1 2; do
    grep -q "^worker $w: .* 100 rollouts stored, 0 failed" "$tmp/w$w.log" ||
        fail "worker $w did not store its 100 rollouts"
done
tail -n 1 "$tmp/trainer.log" "$tmp/w1.log" "$tmp/w2.log"
echo "rl_example_test: ok"
