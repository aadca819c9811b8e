#!/usr/bin/env bash
# The benchmark in one command: ./run.sh bench [tsbench flags] at the top level, or this script.
# Installs Debian's redis-server when it is missing, builds tensord and tsbench (optimised, no
# sanitizers) in $TS_BENCH_BUILD (default: build), then runs every case once, alternating the
# systems, and prints the table of docs/PERFORMANCE.md. Flags go to tsbench (see --help there):
#   --repeats N (default 5), --smoke, --no-redis, --no-pin, --skip putget,small,notify,lz4,memory
# "bench/run.sh stall [flags]" runs bench_stall instead (the worst PING round trip while one LIST,
# SAVE, large PUT or mass wake-up runs; see bench/bench_stall.c for its flags).
# "bench/run.sh python [flags]" runs bench/python_bench.py: the Python package against the C client
# and redis-py (--repeats N, --smoke, --no-redis, --no-pin, --raw).
# "bench/run.sh rows [flags]" runs bench/rows_bench.py: gathering rows of a tensor bin over TCP,
# the unix socket and by reference, against numpy.memmap (--repeats N, --rounds N, --smoke).
# "bench/run.sh balance [flags]" runs slot_balance: how evenly slots spread 100,000 bin names over
# 3, 16 and 64 shards of the default split (--names N, --seed S; no server, no Redis).
# "bench/run.sh cluster [flags]" runs cluster_bench: the cluster client against a plain client of
# the same daemon on small operations (--repeats N, --ops N, --no-pin).
# "bench/run.sh tls [flags]" runs tls_bench: 64 MiB put+get over TLS against plain TCP, in one run
# (--repeats N, --mib M, --iters I, --no-pin).
# "bench/run.sh replay [flags]" runs replay_bench: replay tables, 8 inserters and 8 samplers.
# "bench/run.sh coord [flags]" runs coord_bench: ADD against Redis INCR (--repeats N, --clients C,
# --secs S, --no-pin, --smoke).
# "bench/run.sh stream [flags]" runs stream_bench: one producer feeding four consumer processes
# through a stream against four independent loaders, kill/pause/late-join stalls, and the
# append-to-reader latency against Redis Streams (--repeats N, --smoke, --no-redis, --no-pin,
# --unix, --batches N, --passes N, --skip share,fail,latency, --raw).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${TS_BENCH_BUILD:-build}

if [ "${1:-}" != "stall" ] && [ "${1:-}" != "rows" ] && [ "${1:-}" != "balance" ] &&
    [ "${1:-}" != "tls" ] && [ "${1:-}" != "cluster" ] &&
    ! command -v redis-server >/dev/null 2>&1 &&
    [ ! -x /usr/bin/redis-server ]; then
    echo "bench/run.sh: installing redis-server (the reference the benchmark compares with)"
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        redis-server
    # The package starts a system-wide instance; the benchmark starts its own, pinned.
    $sudo systemctl stop redis-server >/dev/null 2>&1 || $sudo service redis-server stop \
        >/dev/null 2>&1 || true
fi

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD.configure.log" 2>&1 ||
        { cat "$BUILD.configure.log"; exit 1; }
fi
if grep -q "^TS_SANITIZE:STRING=..*" "$BUILD/CMakeCache.txt"; then
    echo "bench/run.sh: $BUILD is a sanitizer build; set TS_BENCH_BUILD to an optimised one" >&2
    exit 1
fi
if [ "${1:-}" = "balance" ]; then
    # The slot function over many names (bench/slot_balance.c): no server, nothing to pin.
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target slot_balance
    exec "$BUILD/bench/slot_balance" "$@"
fi
if [ "${1:-}" = "tls" ]; then
    # 64 MiB put+get over TLS against plain TCP in the same run (bench/tls_bench.c): tensord on
    # cpu0, the client on cpu1, alternating, medians (--repeats N, --mib M, --iters I, --no-pin).
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target tls_bench tensord
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    exec "$BUILD/bench/tls_bench" --tensord "$BUILD/server/tensord" "$@"
fi
if [ "${1:-}" = "cluster" ]; then
    # The cluster client's cost per small operation against a plain client of the same daemon
    # (bench/cluster_bench.c): tensord on cpu0, both clients on cpu1, alternating, medians
    # (--repeats N, --ops N, --no-pin).
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target cluster_bench tensord
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    exec "$BUILD/bench/cluster_bench" --tensord "$BUILD/server/tensord" "$@"
fi
if [ "${1:-}" = "stall" ]; then
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target bench_stall tensord
    exec "$BUILD/bench/bench_stall" --tensord "$BUILD/server/tensord" "$@"
fi
if [ "${1:-}" = "python" ]; then
    # The Python package against the C client and redis-py (bench/python_bench.py), with the
    # interpreter the extension was built for.
    shift
    py=$(sed -n 's/^TS_PYTHON:FILEPATH=//p' "$BUILD/CMakeCache.txt")
    py=${py:-python3}
    if ! "$py" -c 'import redis, hiredis' 2>/dev/null; then
        echo "bench/run.sh: installing python3-redis and python3-hiredis (the Python reference)"
        sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo"
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            python3-redis python3-hiredis
    fi
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target tensord tsrounds \
        tsp_extension
    prio=()
    if nice -n -20 true 2>/dev/null; then
        prio=(nice -n -20)
    fi
    PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" exec "${prio[@]}" "$py" \
        bench/python_bench.py --build "$BUILD" "$@"
fi
if [ "${1:-}" = "rows" ]; then
    # Row gathers of a tensor bin against numpy.memmap (bench/rows_bench.py), with the
    # interpreter the extension was built for (NumPy from Debian's python3-numpy).
    shift
    py=$(sed -n 's/^TS_PYTHON:FILEPATH=//p' "$BUILD/CMakeCache.txt")
    py=${py:-python3}
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target tensord tsp_extension
    PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" exec "$py" bench/rows_bench.py \
        --build "$BUILD" "$@"
fi
if [ "${1:-}" = "replay" ]; then
    # Replay tables: 8 inserters and 8 samplers, 4 KiB items (bench/replay_bench.c), beside
    # Reverb's published figures.
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target replay_bench tensord
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    exec "$BUILD/bench/replay_bench" --tensord "$BUILD/server/tensord" "$@"
fi
if [ "${1:-}" = "coord" ]; then
    # Counter increments: tensord's ADD against Redis INCR (bench/coord_bench.c), pinned,
    # alternating, medians of --repeats runs, at the highest priority allowed.
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target coord_bench tensord
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    prio=()
    if nice -n -20 true 2>/dev/null; then
        prio=(nice -n -20)
    fi
    exec "${prio[@]}" "$BUILD/bench/coord_bench" --tensord "$BUILD/server/tensord" "$@"
fi
if [ "${1:-}" = "stream" ]; then
    # Streams against independent loaders and Redis Streams (bench/stream_bench.c), at the
    # highest priority allowed, like tsbench below.
    shift
    cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target stream_bench tensord
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    prio=()
    if nice -n -20 true 2>/dev/null; then
        prio=(nice -n -20)
    fi
    exec "${prio[@]}" "$BUILD/bench/stream_bench" --tensord "$BUILD/server/tensord" "$@"
fi
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target tsbench tensord

if [ "$(nproc)" -ge 2 ]; then
    echo "bench/run.sh: load before the run: $(cut -d' ' -f1-3 /proc/loadavg)" \
        "(numbers are only meaningful on an otherwise idle machine)"
fi
# On a shared machine, other work would take turns with the systems being measured; the highest
# priority (inherited by the servers tsbench starts) keeps the comparison fair when allowed.
prio=()
if nice -n -20 true 2>/dev/null; then
    prio=(nice -n -20)
fi
exec "${prio[@]}" "$BUILD/bench/tsbench" --tensord "$BUILD/server/tensord" "$@"
