#!/bin/sh
# install_test.sh BUILD_DIR SOURCE_DIR TENSORD MODEL [SANITIZER_FLAGS]
#
# Installs the build into a temporary prefix, then builds examples/batch_quickstart.c outside the
# tree with plain cc and `pkg-config --cflags --libs tensorshare-torch`, and runs it with MODEL
# (tests/shim's dict.pt) in process and through a tensord started here. Everything started or
# written is removed on exit.
set -eu
build=$1
src=$2
tensord=$3
model=$4
sanflags=${5:-}
cc=${CC:-cc}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ts-torch-install.XXXXXX")
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
    echo "shim install_test: $*"
}
fail() {
    echo "shim install_test: $*"
    exit 1
}

step "cmake --install into $tmp/prefix"
if ! cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1; then
    cat "$tmp/install.log"
    exit 1
fi
pc=$(find "$tmp/prefix" -name tensorshare-torch.pc | head -n 1)
[ -n "$pc" ] || fail "tensorshare-torch.pc was not installed"
libdir=$(dirname "$(dirname "$pc")")
for f in include/tensorshare/torch.h include/tensorshare/batcher.h bin/tsinfer; do
    [ -e "$tmp/prefix/$f" ] || fail "$f missing"
done
[ -e "$libdir/libtensorshare_torch.so" ] || fail "libtensorshare_torch.so missing"
export PKG_CONFIG_PATH="$(dirname "$pc")"
step "pkg-config: $(pkg-config --modversion tensorshare-torch), $(pkg-config --cflags --libs tensorshare-torch)"
pkg-config --libs tensorshare-torch | grep -q -- -ltensorshare_torch || fail "no -ltensorshare_torch"
pkg-config --libs tensorshare-torch | grep -q -- "-ltensorshare\( \|$\)" ||
    fail "tensorshare-torch does not bring -ltensorshare"

step "cc batch_quickstart.c \$(pkg-config --cflags --libs tensorshare-torch)"
# shellcheck disable=SC2046,SC2086
$cc $sanflags "$src/examples/batch_quickstart.c" $(pkg-config --cflags --libs tensorshare-torch) \
    -pthread -o "$tmp/batch_quickstart"

step "run it in process"
LD_LIBRARY_PATH="$libdir" timeout 120 "$tmp/batch_quickstart" "$model" >"$tmp/run.log" 2>&1 ||
    { cat "$tmp/run.log"; fail "batch_quickstart failed in process"; }
grep -q "^worker 3: weights v0" "$tmp/run.log" || { cat "$tmp/run.log"; fail "no answer"; }

step "start tensord"
"$tensord" --port 0 --port-file "$tmp/port" --log-level warn &
pid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ $i -le 1500 ] || fail "tensord did not start"
    sleep 0.01
done
port=$(cat "$tmp/port")

step "run it through tensord at 127.0.0.1:$port"
LD_LIBRARY_PATH="$libdir" timeout 120 "$tmp/batch_quickstart" "$model" "127.0.0.1:$port" \
    >"$tmp/run.log" 2>&1 || { cat "$tmp/run.log"; fail "batch_quickstart failed remotely"; }
grep -q "^remote worker: weights v0" "$tmp/run.log" || { cat "$tmp/run.log"; fail "no answer"; }
tail -n 2 "$tmp/run.log"
step "ok"
