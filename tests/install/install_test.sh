#!/bin/sh
# install_test.sh BUILD_DIR SOURCE_DIR TENSORD [SANITIZER_FLAGS]
#
# Installs the build into a temporary prefix, then builds examples/quickstart.c outside the tree
# twice: with plain cc and pkg-config, and through find_package(tensorshare) (shared and static
# targets). Each program runs against a real tensord started here, without LD_LIBRARY_PATH: the
# installed tsctl finds libtensorshare.so.0 through its run path ($ORIGIN/../lib), a program
# built here through the -Wl,-rpath the README shows. Everything started or written is removed
# on exit.
set -eu
build=$1
src=$2
tensord=$3
sanflags=${4:-}
cc=${CC:-cc}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ts-install.XXXXXX")
pid=""
cleanup() {
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

step() {
    echo "install_test: $*"
}

step "cmake --install into $tmp/prefix"
if ! cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1; then
    cat "$tmp/install.log"
    exit 1
fi
pc=$(find "$tmp/prefix" -name tensorshare.pc | head -n 1)
[ -n "$pc" ] || { echo "install_test: tensorshare.pc was not installed"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
export PKG_CONFIG_PATH="$(dirname "$pc")"
for f in include/tensorshare/tensorshare.h include/tensorshare/version.h; do
    [ -f "$tmp/prefix/$f" ] || { echo "install_test: $f missing"; exit 1; }
done
[ -x "$tmp/prefix/bin/tsctl" ] || { echo "install_test: tsctl missing"; exit 1; }
[ -f "$libdir/libtensorshare.a" ] || { echo "install_test: libtensorshare.a missing"; exit 1; }
# The installed programs must run from the prefix on their own (a non-system prefix: the dynamic
# loader would not find libtensorshare.so.0 without their run path).
step "installed tsctl --help, without LD_LIBRARY_PATH"
if ! env -u LD_LIBRARY_PATH "$tmp/prefix/bin/tsctl" --help >"$tmp/help.log" 2>&1; then
    cat "$tmp/help.log"
    echo "install_test: the installed tsctl does not run from its prefix"
    exit 1
fi
step "pkg-config: $(pkg-config --modversion tensorshare), $(pkg-config --cflags --libs tensorshare)"
pkg-config --static --libs tensorshare | grep -q -- -luv ||
    { echo "install_test: --static does not bring libuv"; exit 1; }

step "cc quickstart.c \$(pkg-config --cflags --libs tensorshare) -Wl,-rpath,<libdir>"
# shellcheck disable=SC2046,SC2086
$cc $sanflags "$src/examples/quickstart.c" $(pkg-config --cflags --libs tensorshare) \
    -Wl,-rpath,"$(pkg-config --variable=libdir tensorshare)" -o "$tmp/quickstart"

step "find_package(tensorshare) from a separate CMake project"
if ! cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" \
    -DCMAKE_PREFIX_PATH="$tmp/prefix" -DQUICKSTART="$src/examples/quickstart.c" \
    -DCMAKE_C_FLAGS="$sanflags" -DCMAKE_EXE_LINKER_FLAGS="$sanflags" \
    -DCMAKE_BUILD_RPATH="$libdir" >"$tmp/consumer.log" 2>&1 ||
    ! cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1; then
    cat "$tmp/consumer.log"
    exit 1
fi

step "start tensord"
"$tensord" --port 0 --port-file "$tmp/port" --log-level warn &
pid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ $i -le 1500 ] || { echo "install_test: tensord did not start"; exit 1; }
    sleep 0.01
done
port=$(cat "$tmp/port")

for prog in "$tmp/quickstart" "$tmp/consumer/quickstart_shared" "$tmp/consumer/quickstart_static"; do
    step "run $(basename "$prog") against 127.0.0.1:$port"
    if ! env -u LD_LIBRARY_PATH timeout 120 "$prog" "127.0.0.1:$port" >"$tmp/run.log" 2>&1; then
        cat "$tmp/run.log"
        echo "install_test: $(basename "$prog") failed"
        exit 1
    fi
    tail -n 1 "$tmp/run.log"
done
step "installed tsctl ping, without LD_LIBRARY_PATH"
env -u LD_LIBRARY_PATH "$tmp/prefix/bin/tsctl" --port "$port" ping
step "ok"
