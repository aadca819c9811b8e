#!/usr/bin/env bash
# GPU checks of the libtorch shim and the batcher: build against a CUDA-enabled libtorch and run
# the torch-labelled tests (they exercise cuda:0 when a GPU is visible: placements, weights,
# autocast in float16, each model on its own stream), then batcher_bench's limit and ratio rows
# with the big MLP (8 -> 2048 x 3 -> 4, float32) on cuda:0 at max batch 256 and 1024: one
# replica, with 8 answer helper threads, with helpers answering while the replica runs the next
# batch (overlap_answers, twice max batch requesters), two replicas (two batches in flight on
# the GPU), float16 autocast; and the small MLP on cuda:0.
# Not part of the CI suite (CI machines have no GPU, and Debian's libtorch is CPU-only). Takes
# about 6 minutes on one H100 with 16 cores; every step has its own time limit, and a step that
# fails or runs out of time marks the run failed without stopping the others.
#
#   tests/gpu/run_gpu_checks.sh [DEB_DIR]
#
# Results go to $OUT (default /tmp/ts-gpu-out): configure.log, build.log, ctest-torch.log,
# bench-gpu.log (every benchmark's whole output) and summary.txt (the ratio lines).
#
# libtorch: TORCH_CMAKE_DIR if set, else the one inside python3's torch package.
# DEB_DIR (optional): Debian packages (libuv1, libuv1-dev, liblz4-1, liblz4-dev, libcmocka0, libdlpack-dev,
# libcmocka-dev, pkgconf, pkgconf-bin, libpkgconf3) to unpack into a private prefix, for a
# machine that has a GPU but not these libraries and no package manager access.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts-gpu-out}
mkdir -p "$OUT"

if [ $# -ge 1 ]; then
    dep=/tmp/ts-gpu-deps
    rm -rf "$dep" && mkdir -p "$dep"
    for f in "$1"/*.deb; do dpkg -x "$f" "$dep"; done
    multi=$dep/usr/lib/x86_64-linux-gnu
    export PATH=$dep/usr/bin:$PATH
    export LD_LIBRARY_PATH=$multi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PKG_CONFIG_PATH=$multi/pkgconfig
    export PKG_CONFIG_SYSROOT_DIR=$dep
    [ -x "$dep/usr/bin/pkg-config" ] || ln -sf pkgconf "$dep/usr/bin/pkg-config"
    # The .pc files name /usr/lib/...: make the libraries findable by the linker there too.
    export LIBRARY_PATH=$multi
    export CPATH=$dep/usr/include
    # find_path (dlpack/dlpack.h) searches the prefix path, not CPATH.
    export CMAKE_PREFIX_PATH=$dep/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
fi

nvidia-smi -L || true
torch_dir=${TORCH_CMAKE_DIR:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch}
echo "libtorch: $torch_dir"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' || true

cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTS_WITH_TORCH=ON -DTorch_DIR="$torch_dir" \
    -DTS_BUILD_EXAMPLES=OFF >"$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
# Every target the torch-labelled tests and the benchmark need (test_torch_install, which installs
# the whole build, is left out below: it would need every target of the project).
cmake --build build-gpu -j "$(nproc)" --target tensord tensorshare tensorshare_torch tsinfer \
    make_models test_torch test_tsinfer batcher_bench >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }

status=0
(cd build-gpu && timeout 240 ctest -L torch -E test_torch_install --output-on-failure -V) \
    >"$OUT/ctest-torch.log" 2>&1 || status=1
grep -E "CUDA device|cuda|autocast|Test +#|tests passed|FAILED" "$OUT/ctest-torch.log" | head -40

bench=build-gpu/bench/batcher_bench
export TS_MAKE_MODELS=build-gpu/tests/shim/make_models
models=build-gpu/gpu-models
mkdir -p "$models"
# One benchmark run: a header line, its whole output to bench-gpu.log, its ratio lines to the
# summary. 90 s at most each.
run_bench() {
    echo "== batcher_bench $*" | tee -a "$OUT/bench-gpu.log" >>"$OUT/summary.txt"
    timeout 90 "$bench" "$@" >>"$OUT/bench-gpu.log" 2>&1 || { echo "   (failed or timed out)" >>"$OUT/summary.txt"; status=1; }
    # The medians and ratios of the run just made (after its last header line).
    awk '/^== batcher_bench/ {buf=""} {buf = buf $0 "\n"} END {printf "%s", buf}' "$OUT/bench-gpu.log" |
        grep -E "median|the limit|x the best|us per batch" >>"$OUT/summary.txt" || true
}
# Each batched run also prints, per replica, its batch sizes and the time per batch of the input
# copy, the forward and the answers (ts_batcher_replica_stats): where a batch's time goes.
export TS_BENCH_SIZES=1
: >"$OUT/summary.txt"
if [ -x "$TS_MAKE_MODELS" ] && "$TS_MAKE_MODELS" "$models" >/dev/null 2>&1 && [ -f "$models/mlp.pt" ]; then
    big=(--mlp 8,2048,2048,2048,4 --repeats 3)
    # The big MLP: the limit (full batches back to back, with the batcher's copies) against the
    # batched asynchronous and blocking requesters, at max batch 256 and 1024.
    run_bench "${big[@]}" --placement cuda:0 --max-batch 256 --threads 256 --requests 2000 \
        --modes limit,async,batched
    run_bench "${big[@]}" --placement cuda:0 --max-batch 1024 --threads 1024 --requests 500 \
        --modes limit,async,batched
    # The same with 8 threads helping to hand out the answers of each batch.
    run_bench "${big[@]}" --placement cuda:0 --max-batch 1024 --threads 1024 --requests 500 \
        --modes limit,async --answer-threads 8
    # overlap_answers: the helpers hand out one batch's answers while the replica runs the next
    # (two batches in flight per replica), with twice max batch requesters so that the next
    # batch is waiting.
    run_bench "${big[@]}" --placement cuda:0 --max-batch 256 --threads 512 --requests 1000 \
        --modes limit,async --answer-threads 2 --overlap
    run_bench "${big[@]}" --placement cuda:0 --max-batch 1024 --threads 2048 --requests 250 \
        --modes limit,async --answer-threads 4 --overlap
    # Two replicas on the one GPU (two batches in flight, each on its own stream).
    run_bench "${big[@]}" --placement 'cuda:0*2' --max-batch 1024 --threads 1024 --requests 500 \
        --modes limit,async
    run_bench "${big[@]}" --placement 'cuda:0*2' --max-batch 1024 --threads 2048 --requests 250 \
        --modes limit,async --answer-threads 8
    # Mixed precision: float16 autocast at max batch 1024.
    run_bench "${big[@]}" --amp float16 --placement cuda:0 --max-batch 1024 --threads 1024 \
        --requests 500 --modes limit,async
    # The small MLP on cuda:0 (the direct modes, 64 copies of the model on the CPU, left out).
    run_bench --model "$models/mlp.pt" --placement cuda:0 --threads 64 --requests 300 \
        --repeats 3 --modes limit,single,batched,async-single,async
    cat "$OUT/summary.txt"
else
    echo "model generator not found; skipped the benchmark"
    status=1
fi
exit $status
