#!/usr/bin/env bash
# The probe suite on the CUDA engine at its default size (prefixes up to 128K): verifyd runs it
# at start-up; `verifyctl probe` runs it twice more. Prints each run's result and time, and the
# share of GPU time it takes at the default --probe_interval (600 s). Exits non-zero when a probe
# fails on the clean build.
#
#   gpu_probe_cost.sh PACK_DIR OUT_DIR
set -uo pipefail
PACK=$1 OUT=$2
bin=$PACK/bin
dir=$(mktemp -d)
ctl() { "$bin/verifyctl" --timeout=600 --admin="unix:$dir/admin.sock" "$@"; }
"$bin/verifyd" --engine=cuda --listen="unix:$dir/verifyd.sock" --admin_listen="unix:$dir/admin.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --capture_dir="$dir/captures" \
  --log_level=info > "$OUT/probe_daemon.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && break; sleep 0.1; done
[ -S "$dir/admin.sock" ] || { echo "FAIL verifyd did not start"; tail "$OUT/probe_daemon.log"; exit 1; }
status=0
ctl status | grep -E '^probe' || true
for i in 1 2; do
  if ctl probe --json > "$OUT/probe_$i.json"; then
    python3 - "$OUT/probe_$i.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
n = len(j["results"])
print(f"ok   probe run: {sum(r['passed'] for r in j['results'])} of {n} passed in {j['seconds']:.3f} s "
      f"= {100 * j['seconds'] / 600:.3f}% of the GPU at --probe_interval 600 s; slowest: " +
      ", ".join(f"{r['name']} {r['seconds']:.3f} s" for r in sorted(j["results"], key=lambda r: -r["seconds"])[:3]))
PY
  else
    echo "FAIL probe run $i: $(head -c 600 "$OUT/probe_$i.json")"
    status=1
  fi
done
kill "$pid"
wait "$pid" 2>/dev/null
exit $status
