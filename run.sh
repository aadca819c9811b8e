#!/usr/bin/env bash
# tensorshare's one entry point. On a fresh Debian 12 machine, as root:
#   ./run.sh serve [tensord flags]   install what tensord needs, build only tensord (build-serve/),
#                                    start it on port 8000
#   ./run.sh test                    install what is missing, build and run the whole test suite
#   ./run.sh deps | build | bench    the steps on their own
set -euo pipefail
cd "$(dirname "$0")"

# Debian packages the build, the tests and the benchmarks need (the python3-* ones build and
# test the Python package; redis-server and python3-redis/-hiredis are the Python benchmark's
# reference; libssl-dev builds TLS, openssl makes the tests' certificates, prometheus scrapes a
# real tensord in the metrics test, python3-yaml checks the deployment files, iproute2 makes the
# cluster tests' network namespaces, strace and systemd (systemd-analyze) check the deployment
# files' sandbox; python3-matplotlib draws the parameter-server example's loss curves).
PKGS=(build-essential cmake pkg-config libuv1-dev liblz4-dev libcmocka-dev libdlpack-dev
      libtorch-dev clang libclang-rt-14-dev clang-format procps
      python3-dev python3-setuptools python3-pip python3-torch python3-numpy python3-pytest
      python3-redis python3-hiredis redis-server
      libssl-dev openssl prometheus python3-yaml iproute2 curl strace systemd python3-matplotlib)
# What building tensord alone needs (./run.sh serve): no test, benchmark, shim or lint tools.
# libdlpack-dev is there because the configure requires it for the client library's ABI.
SERVE_PKGS=(build-essential cmake pkg-config libuv1-dev liblz4-dev libdlpack-dev libssl-dev)
JOBS=$(nproc 2>/dev/null || echo 2)

# deps [PACKAGES...]: install those of the packages (default: PKGS) that are missing.
deps() {
    local missing=() want=("$@")
    [ ${#want[@]} -gt 0 ] || want=("${PKGS[@]}")
    for p in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "run.sh: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"
}

# build DIR [cmake args...]: configure once, then build (BUILD_TARGET limits what is built).
build() {
    local dir=$1
    shift
    cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >"$dir.configure.log" 2>&1 ||
        { cat "$dir.configure.log"; return 1; }
    cmake --build "$dir" -j "$JOBS" ${BUILD_TARGET:+--target "$BUILD_TARGET"}
}

# check DIR LABEL-REGEX: run ctest and add its counts to the totals.
PASSED=0
FAILED=0
check() {
    local dir=$1 labels=$2 log
    log=$(mktemp)
    local rc=0
    (cd "$dir" && ctest --output-on-failure --timeout 600 -j "$JOBS" ${labels:+-L "$labels"}) \
        2>&1 | tee "$log" || rc=1
    local line
    line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$log" | tail -n 1 || true)
    if [ -n "$line" ]; then
        local total failed
        total=$(echo "$line" | sed -E 's/.* out of ([0-9]+).*/\1/')
        failed=$(echo "$line" | sed -E 's/.* ([0-9]+) tests failed.*/\1/')
        PASSED=$((PASSED + total - failed))
        FAILED=$((FAILED + failed))
    else
        FAILED=$((FAILED + 1))
    fi
    rm -f "$log"
    return $rc
}

# build_failed DIR: a build that failed counts as one failed stage; its tests are skipped (the
# other stages still run, and the summary line still comes).
build_failed() {
    echo "run.sh: the build in $1 failed: its tests are skipped (counted as one failure)"
    FAILED=$((FAILED + 1))
}

# lint: every C/C++ file is clang-formatted; no sprintf/strcpy/strcat/strtok/atoi anywhere, and
# raw malloc/calloc/realloc/free only in src/alloc.c (everything else goes through ts__malloc).
lint() {
    local files ok=0
    files=$(git ls-files '*.c' '*.h' '*.cpp' 2>/dev/null || find src server client shim include \
        tests examples bench -name '*.[ch]' -o -name '*.cpp')
    # shellcheck disable=SC2086
    clang-format --dry-run --Werror $files || ok=1
    # shellcheck disable=SC2086
    if grep -n -E '\b(sprintf|strcpy|strcat|strtok|atoi)[[:space:]]*\(' $files; then
        echo "run.sh: banned function used (see above)"
        ok=1
    fi
    local lib
    lib=$(echo "$files" | tr ' ' '\n' | grep -E '^(src|server|client|shim)/.*\.(c|cpp)$' |
        grep -v '^src/alloc.c$' || true)
    # shellcheck disable=SC2086
    if grep -n -E '(^|[^_a-zA-Z.>])(malloc|calloc|realloc|free)[[:space:]]*\(' $lib; then
        echo "run.sh: raw allocation outside src/alloc.c (use ts__malloc and friends)"
        ok=1
    fi
    return $ok
}

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
deps)
    deps
    ;;
build)
    deps
    build build -DTS_WERROR=ON -DTS_SANITIZE=
    ;;
serve)
    # Only what it starts: the daemon's packages, a configure without tests, benchmarks,
    # examples or the shim, and the tensord target alone, in a build directory of its own (so
    # the full build's settings in build/ stay as they are).
    deps "${SERVE_PKGS[@]}"
    BUILD_TARGET=tensord build build-serve -DTS_SANITIZE= -DTS_WITH_TORCH=OFF \
        -DTS_BUILD_TESTS=OFF -DTS_BUILD_BENCH=OFF -DTS_BUILD_EXAMPLES=OFF
    echo "run.sh: starting tensord on port 8000 (Ctrl-C stops it)"
    exec build-serve/server/tensord --port 8000 "$@"
    ;;
test)
    deps
    rc=0
    echo "== style: clang-format, banned functions"
    if lint; then PASSED=$((PASSED + 1)); else FAILED=$((FAILED + 1)); rc=1; fi
    # GCC warns about some things (possibly uninitialized values, null arguments) only when -O3
    # inlines more, so a Release build that users make must compile cleanly too: compile only.
    echo "== Release build at -O3 (compile only; warnings are errors)"
    if build build-o3 -DCMAKE_BUILD_TYPE=Release -DTS_WERROR=ON -DTS_SANITIZE= \
        -DTS_WITH_TORCH=OFF; then
        PASSED=$((PASSED + 1))
    else
        FAILED=$((FAILED + 1))
        rc=1
    fi
    # Each build runs as an if condition, so a failed one is counted (build_failed) instead of
    # ending the script under set -e before the summary line.
    echo "== release build (warnings are errors)"
    if build build -DTS_WERROR=ON -DTS_SANITIZE=; then
        check build "" || rc=1
    else
        build_failed build
        rc=1
    fi
    echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
    if build build-asan -DTS_WERROR=ON -DTS_SANITIZE=address,undefined \
        -DTS_TEST_TIMEOUT_MULTIPLIER=3 -DTS_BUILD_BENCH=OFF; then
        ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
            check build-asan "" || rc=1
    else
        build_failed build-asan
        rc=1
    fi
    echo "== ThreadSanitizer (unit and client tests; the batcher's timing-sensitive tests run in the release and ASan builds)"
    if build build-tsan -DTS_WERROR=ON -DTS_SANITIZE=thread -DTS_WITH_TORCH=OFF \
        -DTS_TEST_TIMEOUT_MULTIPLIER=4 -DTS_BUILD_BENCH=OFF; then
        TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
            check build-tsan "unit|client" || rc=1
    else
        build_failed build-tsan
        rc=1
    fi
    echo "== libFuzzer targets (clang, ASan + UBSan, bounded time each)"
    if CC=clang BUILD_TARGET=fuzz_all build build-fuzz -DTS_WERROR=ON \
        -DTS_SANITIZE=address,undefined -DTS_WITH_TORCH=OFF -DTS_BUILD_BENCH=OFF \
        -DTS_BUILD_EXAMPLES=OFF; then
        check build-fuzz "fuzz" || rc=1
    else
        build_failed build-fuzz
        rc=1
    fi
    echo "run.sh test: ${PASSED} passed, ${FAILED} failed"
    exit $rc
    ;;
bench)
    deps
    build build -DTS_SANITIZE=
    exec bench/run.sh "$@"
    ;;
*)
    echo "usage: ./run.sh serve|test|deps|build|bench" >&2
    exit 2
    ;;
esac
