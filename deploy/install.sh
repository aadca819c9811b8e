#!/bin/sh
# deploy/install.sh PREFIX: build tensord and tsctl as ./run.sh serve builds tensord, and install
# them under PREFIX (PREFIX/bin/tensord, PREFIX/bin/tsctl, PREFIX/lib/libtensorshare.so.0, which
# tsctl uses and finds through its run path $ORIGIN/../lib). The container build
# (deploy/Containerfile) and a systemd host (docs/DEPLOY.md) both use it.
#
# The build is run.sh's own: `./run.sh serve --version` installs the packages tensord needs,
# configures build-serve/ without tests, benchmarks, examples or the libtorch shim, builds
# tensord, and then starts it with --version, which prints the version and exits 0. Then tsctl
# and libtensorshare (shared, and static because its install rule names both) are built in
# build-serve/ with the same settings; nothing else is (not the Python package, which would be
# built when python3-dev happens to be installed).
set -eu
if [ $# -ne 1 ]; then
    echo "usage: deploy/install.sh PREFIX" >&2
    exit 2
fi
prefix=$1
cd "$(dirname "$0")/.."
./run.sh serve --version
cmake --build build-serve -j "$(nproc 2>/dev/null || echo 2)" \
    --target tsctl tensorshare tensorshare_static
cmake --install build-serve --prefix "$prefix"
