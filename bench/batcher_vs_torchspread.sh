#!/usr/bin/env bash
# The batcher's remote path (predictors through tensord) beside Torch Spread's NetworkClient, in
# one run: for each client count, ROUNDS rounds that run both systems alternately (A/B, then B/A),
# each on the same MLP shape, pinned as bench/run.sh pins (servers cpu0, clients cpu1); then the
# medians and their ratio.
#
#   TORCHSPREAD_DIR=/path/to/TorchSpread bench/batcher_vs_torchspread.sh [BUILD] [CLIENTS] [ROUNDS]
#
# BUILD is an optimised build with TS_WITH_TORCH=ON (default build); CLIENTS a comma-separated
# list (default 8,16,64); ROUNDS at least 3 (default 3). REQUESTS (env, default 300) single-row
# requests per client; MAX_BATCH (default 64) and DELAY_US (the batcher's max_delay_us, default
# its own default) apply to both where they mean the same thing (Torch Spread has no delay).
# The batcher's requesters are threads of one process, each with its own connection to tensord;
# Torch Spread's are separate processes, as its examples use them.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
CLIENTS=${2:-8,16,64}
ROUNDS=${3:-3}
REQUESTS=${REQUESTS:-300}
MAX_BATCH=${MAX_BATCH:-64}
[ -n "${TORCHSPREAD_DIR:-}" ] || { echo "set TORCHSPREAD_DIR to a Torch Spread checkout" >&2; exit 2; }
PY=${PYTHON:-/usr/bin/python3}
# Torch Spread's own imports, from Debian packages when they are missing.
if ! "$PY" -c 'import zmq, lz4, msgpack, torch' 2>/dev/null; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        python3-zmq python3-lz4 python3-msgpack python3-torch
fi
bench=$BUILD/bench/batcher_bench
models=$(mktemp -d /tmp/ts-vs-spread.XXXXXX)
trap 'rm -rf "$models"' EXIT
"$BUILD/tests/shim/make_models" "$models" >/dev/null
delay=()
[ -n "${DELAY_US:-}" ] && delay=(--max-delay-us "$DELAY_US")
echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -n | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }

for n in ${CLIENTS//,/ }; do
    : >"$models/ts.$n" && : >"$models/single.$n" && : >"$models/spread.$n"
    for r in $(seq 1 "$ROUNDS"); do
        run_ts() {
            out=$("$bench" --model "$models/mlp.pt" --modes remote-service --threads "$n" --clients "$n" \
                --requests "$REQUESTS" --repeats 1 --max-batch "$MAX_BATCH" "${delay[@]}" \
                --placement cpu:1 --pin --tensord "$BUILD/server/tensord" 2>/dev/null)
            echo "$out" | awk '$1=="remote" && $2=="max" && $0 ~ /median/ {print $(NF-4)}' >>"$models/ts.$n"
            echo "$out" | awk '$1=="remote" && $2=="one" && $0 ~ /median/ {print $(NF-4)}' >>"$models/single.$n"
        }
        run_spread() {
            TORCHSPREAD_DIR=$TORCHSPREAD_DIR "$PY" bench/torchspread_bench.py --clients "$n" \
                --requests "$REQUESTS" --max-batch "$MAX_BATCH" --repeats 1 --pin 2>/dev/null |
                awk '/median/ {print $NF}' >>"$models/spread.$n"
        }
        if [ $((r % 2)) -eq 1 ]; then run_ts; run_spread; else run_spread; run_ts; fi
        echo "clients $n round $r: batcher $(tail -1 "$models/ts.$n") req/s (one forward per" \
            "request $(tail -1 "$models/single.$n")), Torch Spread $(tail -1 "$models/spread.$n") req/s"
    done
    ts=$(median <"$models/ts.$n")
    single=$(median <"$models/single.$n")
    spread=$(median <"$models/spread.$n")
    awk -v n="$n" -v a="$ts" -v s="$single" -v b="$spread" 'BEGIN {
        printf "clients %d: batcher remote %.0f req/s (medians), one forward per request %.0f, " \
            "Torch Spread %.0f: %.2fx Torch Spread, %.2fx one forward per request\n",
            n, a, s, b, a / b, a / s }'
done
