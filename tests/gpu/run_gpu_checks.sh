#!/usr/bin/env bash
# GPU checks of the libtorch shim and the batcher: build against a CUDA-enabled libtorch and run
# the torch-labelled tests (they exercise cuda:0 when a GPU is visible) and the batcher benchmark
# on cuda:0 next to cpu. Not part of the CI suite (CI machines have no GPU, and Debian's libtorch
# is CPU-only).
#
#   tests/gpu/run_gpu_checks.sh [DEB_DIR]
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
fi

nvidia-smi -L || true
torch_dir=${TORCH_CMAKE_DIR:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch}
echo "libtorch: $torch_dir"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' || true

cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTS_WITH_TORCH=ON -DTorch_DIR="$torch_dir" \
    -DTS_BUILD_EXAMPLES=OFF >"$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target tensord tensorshare tensorshare_torch tsinfer \
    make_models test_torch test_tsinfer batcher_bench >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }

status=0
(cd build-gpu && ctest -L torch --output-on-failure -V) >"$OUT/ctest-torch.log" 2>&1 || status=1
grep -E "CUDA device|cuda|Test +#|tests passed|FAILED" "$OUT/ctest-torch.log" | head -40

models=build-gpu/gpu-models
mkdir -p "$models"
maker=$(find build-gpu/tests/shim -maxdepth 1 -type f -name 'make_models' -perm -u+x | head -n 1)
if [ -n "$maker" ] && "$maker" "$models" >/dev/null 2>&1 && [ -f "$models/mlp.pt" ]; then
    for placement in cpu:2 cuda:0 "cuda:0*2"; do
        echo "== batcher_bench --placement $placement"
        build-gpu/bench/batcher_bench --model "$models/mlp.pt" --placement "$placement" \
            --threads 64 --requests 300 2>&1 | tail -n 6 | tee -a "$OUT/bench.log" || status=1
    done
else
    echo "model generator not found; skipped the benchmark"
fi
exit $status
