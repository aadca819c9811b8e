#!/bin/sh
# check_exports.sh LIBRARY: the shared library exports only the public ts_* API (no ts__
# internals, nothing from libuv or lz4), plus the linker's own _init/_fini style symbols, and
# carries the major version in its SONAME.
set -eu
lib=$1
syms=$(nm -D --defined-only "$lib" | awk '{print $NF}')
bad=$(printf '%s\n' "$syms" | grep -Ev '^(ts_[a-z][a-z0-9_]*|_init|_fini|_edata|_end|__bss_start)$' || true)
count=$(printf '%s\n' "$syms" | grep -c '^ts_[a-z]' || true)
if [ -n "$bad" ]; then
    echo "check_exports: $lib exports symbols outside the public API:"
    printf '  %s\n' $bad
    exit 1
fi
if [ "$count" -lt 50 ]; then
    echo "check_exports: only $count ts_* symbols exported from $lib"
    exit 1
fi
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
case "$soname" in
libtensorshare.so.[0-9]*) ;;
*)
    echo "check_exports: unexpected SONAME '$soname'"
    exit 1
    ;;
esac
echo "check_exports: $count public symbols, nothing else; SONAME $soname"
