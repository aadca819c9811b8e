#!/usr/bin/env bash
# GPU-machine checks of the Python package: build tensord and the extension for the machine's own
# python3 (a newer torch and NumPy than Debian's), run the whole pytest suite against it, then the
# CUDA behaviour docs/PYTHON.md promises: a CUDA tensor is refused with RecordError and nothing
# reaches the server; received tensors go to the GPU with .cuda() and come back bit-exact; views
# of received buffers are zero-copy. Not part of the CI suite (CI machines have no GPU).
#
#   tests/gpu/run_python_checks.sh [DEB_DIR]
#
# DEB_DIR as for run_gpu_checks.sh: Debian packages of libuv, liblz4, libdlpack and pkgconf to
# unpack into a private prefix when the machine lacks them. Results go to $OUT (default
# /tmp/ts-gpu-out): python-build.log, python-pytest.log, python-cuda.log. About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ts-gpu-out}
mkdir -p "$OUT"

if [ $# -ge 1 ]; then
    dep=/tmp/ts-gpu-deps-py
    rm -rf "$dep" && mkdir -p "$dep"
    for f in "$1"/*.deb; do dpkg -x "$f" "$dep"; done
    multi=$dep/usr/lib/x86_64-linux-gnu
    export PATH=$dep/usr/bin:$PATH
    export LD_LIBRARY_PATH=$multi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PKG_CONFIG_PATH=$multi/pkgconfig
    export PKG_CONFIG_SYSROOT_DIR=$dep
    [ -x "$dep/usr/bin/pkg-config" ] || ln -sf pkgconf "$dep/usr/bin/pkg-config"
    export LIBRARY_PATH=$multi
    export CPATH=$dep/usr/include
    export CMAKE_PREFIX_PATH=$dep/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
fi

py=$(command -v python3)
echo "python: $py ($("$py" --version 2>&1))"
"$py" -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "numpy", numpy.__version__)'

build=build-gpu-py
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTS_WITH_TORCH=OFF -DTS_BUILD_PYTHON=ON \
    -DTS_PYTHON="$py" -DTS_BUILD_BENCH=OFF -DTS_BUILD_EXAMPLES=OFF >"$OUT/python-build.log" 2>&1 ||
    { tail -40 "$OUT/python-build.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target tensord tsp_extension >>"$OUT/python-build.log" 2>&1 ||
    { tail -60 "$OUT/python-build.log"; exit 1; }

export TS_TENSORD=$PWD/$build/server/tensord TS_PYTHONPATH=$PWD/$build/python TS_BUILD_DIR=$PWD/$build
export PYTHONDONTWRITEBYTECODE=1
status=0
(cd tests/python && timeout 300 "$py" -m pytest -q -p no:cacheprovider .) \
    >"$OUT/python-pytest.log" 2>&1 || status=1
tail -n 15 "$OUT/python-pytest.log"

# The CUDA promises, against a tensord of its own.
sock=$(mktemp -d)/tensord.sock
"$TS_TENSORD" --port 0 --unix "$sock" >"$OUT/python-tensord.log" 2>&1 &
pid=$!
for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
TS_SOCK=$sock timeout 120 "$py" - >"$OUT/python-cuda.log" 2>&1 <<'EOF' || status=1
import os, sys
sys.path.insert(0, os.environ["TS_PYTHONPATH"])
import torch
import tensorshare as ts

assert torch.cuda.is_available(), "no CUDA device visible"
c = ts.Client("unix:" + os.environ["TS_SOCK"])
dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
# A CUDA tensor is refused before anything is sent: the bin stays absent.
try:
    c.put("gpu", torch.ones(4, device="cuda"))
    print("FAIL: a CUDA tensor was accepted")
    sys.exit(1)
except ts.RecordError as e:
    print("CUDA tensor refused:", e)
assert "gpu" not in [b.name if hasattr(b, "name") else b for b in c.list()], "the bin was created"
# Host copies go through, and received views move to the GPU and back bit-exact.
for dt in dtypes:
    src = (torch.rand(3, 5, 7, device="cuda") * 100).to(dt)
    c.put("t", src.cpu())
    [got] = c.get("t")
    back = got.cuda()
    assert back.dtype == dt and torch.equal(back.cpu(), src.cpu()), dt
    print("ok", dt)
# Pinned host memory is a CPU tensor as far as the client is concerned.
pinned = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
c.put("p", pinned)
assert torch.equal(c.get("p")[0].cuda().cpu(), pinned)
print("pinned ok")
c.close()
print("python cuda checks passed")
EOF
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
cat "$OUT/python-cuda.log"
exit $status
