#!/bin/sh
# prometheus_test.sh TENSORD TSCTL
#
# A real Prometheus scrapes a real tensord: tensord starts with --http-port 0, tsctl makes 5 PUTs
# and a GET of a missing bin, Debian's /usr/bin/prometheus (or $PROMETHEUS) scrapes
# 127.0.0.1:<the HTTP port> every second, and the test asks Prometheus's HTTP API until the
# samples it stored say what was done (bounded: 60 s): tensord_operations_total{op="PUT"} = 5,
# the PUT latency histogram's count = 5, one NOT_FOUND error, and up = 1 for the target.
# tensord must then stop cleanly (exit 0) while Prometheus still holds its keep-alive connection.
# Both are stopped by PID; the temporary directory is removed. Without Prometheus the test
# fails: the package is prometheus.
set -eu
tensord=$1 tsctl=$2
prom=${PROMETHEUS:-/usr/bin/prometheus}
if [ ! -x "$prom" ]; then
    echo "prometheus_test: $prom is missing (install the Debian package prometheus)"
    exit 1
fi
py=$(command -v python3 || true)
[ -n "$py" ] || { echo "prometheus_test: python3 is missing"; exit 1; }

tmp=$(mktemp -d)
tpid= ppid=
cleanup() {
    [ -n "$ppid" ] && kill "$ppid" 2>/dev/null && wait "$ppid" 2>/dev/null
    [ -n "$tpid" ] && kill "$tpid" 2>/dev/null && wait "$tpid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
    echo "prometheus_test: $*"
    echo "--- tensord log"; cat "$tmp/tensord.log" 2>/dev/null || true
    echo "--- prometheus log (last 30 lines)"; tail -n 30 "$tmp/prometheus.log" 2>/dev/null || true
    exit 1
}

"$tensord" --port 0 --port-file "$tmp/port" --http-port 0 --http-port-file "$tmp/http" \
    --log-level warn >"$tmp/tensord.log" 2>&1 &
tpid=$!
i=0
while [ ! -s "$tmp/port" ] || [ ! -s "$tmp/http" ]; do
    i=$((i + 1))
    [ "$i" -le 150 ] || fail "tensord did not start"
    sleep 0.1
done
port=$(cat "$tmp/port")
http=$(cat "$tmp/http")

for v in 1 2 3 4 5; do
    "$tsctl" -p "$port" put prom.bin "$v" >/dev/null || fail "tsctl put failed"
done
set +e
"$tsctl" -p "$port" get prom.missing >/dev/null 2>&1
rc=$?
set -e
[ "$rc" -eq 4 ] || fail "tsctl get of a missing bin exited $rc, expected 4"

# A free port for Prometheus: bound and released by the kernel's choice.
pport=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: tensord
    scrape_interval: 1s
    scrape_timeout: 1s
    static_configs:
      - targets: ['127.0.0.1:$http']
EOF
"$prom" --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$pport" >"$tmp/prometheus.log" 2>&1 &
ppid=$!

# query EXPR: print the value of the first sample of an instant query ("" when none yet).
query() {
    "$py" - "$pport" "$1" <<'EOF'
import json, sys, urllib.parse, urllib.request
port, expr = sys.argv[1], sys.argv[2]
url = "http://127.0.0.1:%s/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": expr}))
try:
    with urllib.request.urlopen(url, timeout=2) as r:
        doc = json.load(r)
except Exception:
    sys.exit(0)
res = doc.get("data", {}).get("result", [])
if doc.get("status") == "success" and res:
    print(res[0]["value"][1])
EOF
}

want() { # want EXPR VALUE: wait (bounded, 60 s in all) until the query gives VALUE
    while :; do
        got=$(query "$1")
        [ "$got" = "$2" ] && return 0
        now=$(date +%s)
        [ "$now" -lt "$deadline" ] || fail "$1 = '$got' after 60 s, expected $2"
        kill -0 "$ppid" 2>/dev/null || fail "prometheus exited"
        sleep 0.5
    done
}

deadline=$(($(date +%s) + 60))
want 'tensord_operations_total{op="PUT"}' 5
want 'tensord_operation_duration_seconds_count{op="PUT"}' 5
want 'tensord_errors_total{status="NOT_FOUND"}' 1
want 'up{job="tensord"}' 1
want 'tensord_bins' 1
# Every line of the page was accepted: the target's last scrape has no error.
err=$("$py" - "$pport" <<'EOF'
import json, sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:%s/api/v1/targets" % sys.argv[1], timeout=2) as r:
    doc = json.load(r)
t = doc["data"]["activeTargets"]
print("ok" if len(t) == 1 and t[0]["health"] == "up" and t[0]["lastError"] == "" else t)
EOF
)
[ "$err" = "ok" ] || fail "the target reports: $err"

# tensord stops cleanly while Prometheus keeps its connection open (bounded: 15 s).
kill "$tpid"
i=0
while kill -0 "$tpid" 2>/dev/null; do
    i=$((i + 1))
    [ "$i" -le 150 ] || fail "tensord did not stop within 15 s"
    sleep 0.1
done
set +e
wait "$tpid"
rc=$?
set -e
tpid=
[ "$rc" -eq 0 ] || fail "tensord exited $rc"
echo "prometheus_test: ok"
