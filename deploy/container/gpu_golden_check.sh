#!/usr/bin/env bash
# On a GPU machine: what the CUDA image would run, checked end to end. STAGED is made by
# gpu_stage.sh from the CUDA build (its binaries, and the libraries the image's runtime stage
# installs); the CUDA libraries come from the machine (/usr/local/cuda/lib64), as they come from
# the CUDA runtime image in the container.
#   deploy/container/gpu_golden_check.sh STAGED [GOLDEN_DIR]   (default: tests/data/golden)
# Checks, each one line PASS or FAIL, then "N passed, N failed"; exits 1 on any failure:
#   1. every shared library of the binaries resolves (the image's library set is enough);
#   2. with no GPU visible, verifyd --engine=cuda refuses to start, saying why;
#   3. verifyd with the DaemonSet's flags (--engine=cuda; sockets, state and metrics moved into
#      a temp dir) becomes ready: /readyz answers 200, `verifyctl status` reports the CUDA
#      engine and a passed start-up probe;
#   4. calls through its data socket (`verifyctl send`) succeed;
#   5. every golden case replays on the CUDA engine (verifyd-replay, or `verifyctl replay` in
#      builds without it) with each path (reference, custom, oracle) within tolerance of the
#      case's fp64 answer;
#   6. verifyd exits 0 on SIGTERM.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
staged=$(cd "${1:?usage: gpu_golden_check.sh STAGED [GOLDEN_DIR]}" && pwd)
golden=$(cd "${2:-$here/../../tests/data/golden}" && pwd)
bin=$staged/bin
export LD_LIBRARY_PATH="$staged/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tmp=$(mktemp -d /tmp/verifyd-gpu-golden.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
passed=0 failed=0
pass() { echo "PASS: $*"; passed=$((passed + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
http_status() {  # http_status URL: the status code, or 000
  python3 - "$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except OSError:
    print("000")
PY
}

if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
fi

# 1. The libraries.
missing=$(for b in "$bin"/*; do ldd "$b" | grep "not found" | sed "s|^|$(basename "$b"): |"; done)
if [ -z "$missing" ]; then
  pass "every shared library of $(ls "$bin" | tr '\n' ' ')resolves"
else
  fail "unresolved libraries:"$'\n'"$missing"
fi

# 2. No GPU visible: refused, with the reason.
out=$(CUDA_VISIBLE_DEVICES= timeout 60 "$bin/verifyd" --engine=cuda \
  --listen="unix:$tmp/nogpu/verifyd.sock" --admin_listen="unix:$tmp/nogpu/admin.sock" \
  --metrics_address= --state_dir="$tmp/nogpu/state" 2>&1)
rc=$?
if [ "$rc" != 0 ] && [ "$rc" != 124 ] && grep -q "engine: cuda requested but no GPU is visible" <<< "$out"; then
  pass "no GPU visible: verifyd --engine=cuda exits $rc: $(grep -o 'engine: .*' <<< "$out" | head -1)"
else
  fail "no GPU visible: verifyd --engine=cuda exited $rc without refusing:"$'\n'"$out"
fi

# 3. The DaemonSet's flags, on the GPU.
log=$tmp/verifyd.log
"$bin/verifyd" --listen="unix:$tmp/run/verifyd.sock" --admin_listen="unix:$tmp/run/admin.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$tmp/state" --capture_dir="$tmp/state/captures" \
  --engine=cuda --cuda_pool_mb=8192 > "$log" 2>&1 &
pid=$!
ready=0
for _ in $(seq 1 600); do  # the start-up probe runs at the CUDA engine's size first
  if grep -q "data plane on" "$log"; then ready=1; break; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
metrics=$(grep -o 'metrics on http://[^/ ]*' "$log" | head -1 | sed 's/^metrics on //')
ctl=("$bin/verifyctl" --admin="unix:$tmp/run/admin.sock" --target="unix:$tmp/run/verifyd.sock")
if [ "$ready" != 1 ]; then
  fail "verifyd --engine=cuda did not become ready:"$'\n'"$(tail -20 "$log")"
else
  code=$(http_status "$metrics/readyz")
  "${ctl[@]}" --json status > "$tmp/status.json" 2>&1
  summary=$(python3 - "$tmp/status.json" <<'PY' 2>&1
import json, sys
s = json.load(open(sys.argv[1]))
e, p = s["engine"], s.get("probe", {})
probe = "probe passed" if p.get("last_passed") else "probe NOT passed: " + p.get("last_summary", "")
print(f"{e['engine']} {e['device']} sm_{e['compute_capability']}; {probe}")
PY
)
  if [ "$code" = 200 ] && [[ $summary == "cuda "*"probe passed"* ]]; then
    pass "verifyd --engine=cuda ready: /readyz 200; $summary"
  else
    fail "verifyd --engine=cuda: /readyz $code; status: $summary"$'\n'"$(cat "$tmp/status.json")"
  fi

  # 4. Calls through the data socket.
  if send=$("${ctl[@]}" send --count 64 --concurrency 4 2>&1); then
    pass "verifyctl send over the data socket: $(tail -1 <<< "$send")"
  else
    fail "verifyctl send over the data socket:"$'\n'"$send"
  fi
fi

# 5. The golden cases on the CUDA engine.
replay=("$bin/verifyctl" replay)
[ -x "$bin/verifyd-replay" ] && replay=("$bin/verifyd-replay")
"${replay[@]}" --engine cuda --json "$golden"/*.safetensors > "$tmp/replay.json" 2> "$tmp/replay.err"
rc=$?
report=$(python3 - "$tmp/replay.json" <<'PY' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit("no JSON from the replay")
if "files" not in r:
    sys.exit(r.get("error", json.dumps(r)))
worst, bad = {}, []
for f in r["files"]:
    name = f["file"].rsplit("/", 1)[-1]
    if "error" in f or "golden" not in f:
        bad.append(f"{name}: {f.get('error', 'no golden answer in the file')}")
        continue
    if not f["engine"].startswith("cuda"):
        bad.append(f"{name}: ran on {f['engine']}")
    for path, st in f["golden"].items():
        worst[path] = max(worst.get(path, 0.0), st["rel_l2"] or 0.0)
        if not st["match"]:
            bad.append(f"{name}: {path}: {st['reason']}")
print(f"{len(r['files'])} cases; worst rel-L2 vs fp64: "
      + ", ".join(f"{p} {v:.3g}" for p, v in sorted(worst.items())))
for b in bad:
    print("  " + b)
sys.exit(1 if bad or not r["ok"] else 0)
PY
)
prc=$?
if [ "$rc" = 0 ] && [ "$prc" = 0 ]; then
  pass "golden cases on the CUDA engine (${replay[*]##*/}): $report"
else
  fail "golden cases on the CUDA engine (${replay[*]##*/}, exit $rc): $report"$'\n'"$(cat "$tmp/replay.err")"
fi

# 6. A clean stop.
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  pid=
  if [ "$rc" = 0 ]; then pass "verifyd exits 0 on SIGTERM"; else fail "verifyd exited $rc on SIGTERM"; fi
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
