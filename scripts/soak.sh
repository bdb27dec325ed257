#!/usr/bin/env bash
# Soak: runs the release verifyd on the CPU engine under SOAK_STREAMS streams and SOAK_UNARY unary
# callers of tiny bundles (one message in SOAK_BAD_EVERY deliberately bad) for SOAK_SECONDS, and
# reports calls/s, status codes, the daemon's RSS and threads every 10 s, and the comparisons
# verifyd_comparisons_total counts (skipped ones included).
# Fails on any unexpected status code, a daemon that dies, or RSS growth from the first sample
# (after 10 s of load) to the last over SOAK_RSS_GROWTH_MB.
#   scripts/soak.sh [BUILD_DIR]     (default build/; needs its verifyd binary)
# Env: SOAK_SECONDS (60), SOAK_STREAMS (64), SOAK_UNARY (4), SOAK_BAD_EVERY (50),
#      SOAK_RSS_GROWTH_MB (64), SOAK_CPU_THREADS (2), PYTHON (/usr/bin/python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${BUILD_DIR:-$root/build}}
seconds=${SOAK_SECONDS:-60}
streams=${SOAK_STREAMS:-64}
unary=${SOAK_UNARY:-4}
bad_every=${SOAK_BAD_EVERY:-50}
growth_mb=${SOAK_RSS_GROWTH_MB:-64}
python=${PYTHON:-/usr/bin/python3}
verifyd=$build/src/main/verifyd
[ -x "$verifyd" ] || { echo "soak.sh: $verifyd not built" >&2; exit 1; }

work=$(mktemp -d /tmp/verifyd-soak.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill "$pid"; wait "$pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
"$root/clients/python/generate.sh" "$work/gen" >/dev/null

port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mport=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$verifyd" --engine=cpu --cpu_threads="${SOAK_CPU_THREADS:-2}" --listen="127.0.0.1:$port" \
  --admin_listen="unix:$work/admin.sock" --metrics_address="127.0.0.1:$mport" \
  --state_dir="$work/state" --log_level=error >"$work/verifyd.log" 2>&1 &
pid=$!
metrics() { "$python" -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$mport/metrics', timeout=5).read().decode())"; }
ready() { "$python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$mport/readyz', timeout=5)"; }
# /readyz answers 200 once the start-up probe passed and the listeners are bound.
for _ in $(seq 1200); do ready >/dev/null 2>&1 && break; sleep 0.1; done

rss_mb() { awk '/^VmRSS/ {printf "%d", $2 / 1024}' "/proc/$pid/status"; }
threads() { awk '/^Threads/ {print $2}' "/proc/$pid/status"; }

echo "soak: ${seconds} s, $streams streams + $unary unary callers, verifyd pid $pid"
PYTHONPATH="$work/gen" "$python" "$root/tests/soak/soak_load.py" "127.0.0.1:$port" "$seconds" \
  "$streams" "$unary" "$bad_every" >"$work/load.json" &
load=$!
first_rss=
last_rss=0
t=0
while kill -0 "$load" 2>/dev/null; do
  sleep 10
  t=$((t + 10))
  kill -0 "$load" 2>/dev/null || break  # samples are taken under load only
  kill -0 "$pid" 2>/dev/null || { echo "soak: verifyd died" >&2; tail -20 "$work/verifyd.log" >&2; exit 1; }
  last_rss=$(rss_mb)
  [ -n "$first_rss" ] || first_rss=$last_rss
  echo "  t=${t}s rss=${last_rss} MB threads=$(threads)"
done
load_rc=0
wait "$load" || load_rc=$?
echo "load: $(cat "$work/load.json")"
echo "metrics:"
metrics | grep -E '^verifyd_(requests_total|comparisons_total)' | sed 's/^/  /'
kill -0 "$pid" 2>/dev/null || { echo "soak: verifyd died" >&2; exit 1; }
fail=0
if [ "$load_rc" != 0 ]; then echo "soak: FAIL: unexpected status codes (see 'unexpected')" >&2; fail=1; fi
if [ -n "$first_rss" ] && [ $((last_rss - first_rss)) -gt "$growth_mb" ]; then
  echo "soak: FAIL: RSS grew ${first_rss} -> ${last_rss} MB (bound ${growth_mb} MB)" >&2
  fail=1
fi
[ "$fail" = 0 ] && echo "soak: OK (RSS ${first_rss:-?} -> ${last_rss} MB, bound +${growth_mb} MB)"
exit "$fail"
