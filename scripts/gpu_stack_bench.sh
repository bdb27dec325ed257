#!/usr/bin/env bash
# The serving-stack benchmark on the GPU machine (bench/stack_bench.py): a captured 61-layer step
# with a verify call per layer through a doorbell channel, against the same step without them;
# the eager Python path per call; and the C++ client (verifyctl send --transport cuda_ipc
# --channel --resident) on the same shapes in the same run. Without MPS, then with verifyd and
# the benchmark as clients of one MPS control daemon (quit in a trap).
# With BASELINE_BIN (a folder holding an earlier verifyd; BASELINE_NAME names it in the table, by
# default its --version), that build's graph rows are measured right after this one's, in the
# same MPS setting and the same run, and the table sets them side by side. More than one:
# BASELINE_BIN="DIR1 DIR2" and BASELINE_NAME="NAME1|NAME2", measured in that order (their rows
# carry verifyd: baseline, baseline2, ...). Writes OUT/stack.json (one row per line) and
# OUT/stack.md.
#
#   gpu_stack_bench.sh PACK_DIR OUT_DIR     (STACK_BENCH_ARGS: more arguments for stack_bench.py)
set -uo pipefail
PACK=$1 OUT=$2
bin=$PACK/bin
# shellcheck source=gpu_stack_env.sh
source "$(dirname "$0")/gpu_stack_env.sh"
mkdir -p "$OUT"
rows=$OUT/stack.json
: > "$rows"

start_verifyd() {  # $1: a tag for the log; $2: the folder of the verifyd to run (default: the pack's)
  rm -rf "$dir/state" "$dir"/*.sock
  "${2:-$bin}/verifyd" --engine=cuda --listen="unix:$dir/verifyd.sock" \
    --admin_listen="unix:$dir/admin.sock" --metrics_address=127.0.0.1:0 \
    --state_dir="$dir/state" --capture_dir=off --shadow_threads=2 --shadow_queue=1024 \
    --log_level=warn > "$OUT/stack_verifyd_$1.log" 2>&1 &
  vpid=$!
  for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && return 0; sleep 0.1; done
  echo "FAIL verifyd did not start ($1)"; status=1; return 1
}

cxx_rows() {  # $1: mps 0/1
  for shape in 1,16,16,4096 8,16,16,4096 32,8,16,2048 64,4,16,8192; do
    "$bin/verifyctl" --target="unix:$dir/verifyd.sock" --json send --transport cuda_ipc --channel \
      --resident --shape "$shape" --page_size 64 --count 200 --distinct 1 > "$dir/cxx.json" \
      2> "$dir/cxx.err" || { echo "FAIL verifyctl send $shape: $(tail -2 "$dir/cxx.err")"; status=1; continue; }
    python3 - "$dir/cxx.json" "$shape" "$1" >> "$rows" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(json.dumps(dict(graph=False, client="c++", mps=sys.argv[3] == "1", mode="shadow",
                      shape=[int(x) for x in sys.argv[2].split(",")],
                      cxx_p50_us=j["latency_seconds"]["p50"] * 1e6)))
PY
  done
}

for mps in 0 1; do
  if [[ $mps == 1 ]]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$mps_ctl" -d || { echo "FAIL MPS did not start"; status=1; break; }
  fi
  start_verifyd "mps$mps" || break
  cxx_rows "$mps"
  timeout 400 python3 "$PACK/py/bench/stack_bench.py" --data "unix://$dir/verifyd.sock" \
    --admin "unix://$dir/admin.sock" --mps "$mps" --out "$rows" ${STACK_BENCH_ARGS:-} > "$OUT/stack_mps$mps.txt" 2>&1 ||
    { echo "FAIL stack_bench.py (mps $mps): $(tail -3 "$OUT/stack_mps$mps.txt")"; status=1; }
  kill "$vpid"; wait "$vpid" 2>/dev/null
  i=0
  for base_bin in ${BASELINE_BIN:-}; do
    i=$((i + 1)); label=baseline; [[ $i -gt 1 ]] && label=baseline$i
    start_verifyd "${label}_mps$mps" "$base_bin" || continue
    timeout 300 python3 "$PACK/py/bench/stack_bench.py" --data "unix://$dir/verifyd.sock" \
      --admin "unix://$dir/admin.sock" --mps "$mps" --out "$rows" --label "$label" \
      --eager_calls 0 ${STACK_BENCH_ARGS:-} > "$OUT/stack_${label}_mps$mps.txt" 2>&1 ||
      { echo "FAIL stack_bench.py $label (mps $mps): $(tail -3 "$OUT/stack_${label}_mps$mps.txt")"; status=1; }
    kill "$vpid"; wait "$vpid" 2>/dev/null
  done
  [[ $mps == 1 ]] && quit_mps
done

names=${BASELINE_NAME:-}
if [[ -z $names ]]; then
  for base_bin in ${BASELINE_BIN:-}; do
    names+="${names:+|}$("$base_bin/verifyd" --version 2>/dev/null | head -1)"
  done
fi
python3 - "$rows" "$(cat "$PACK/COMMIT" 2>/dev/null)" "$names" > "$OUT/stack.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def key(r): return (r["mps"], r["mode"], tuple(r["shape"]))
names = [n for n in sys.argv[3].split("|") if n]
labels = ["baseline"] + [f"baseline{i}" for i in range(2, len(names) + 1)]
bases = [{key(r): r for r in rows if r.get("graph") and r.get("verifyd") == l} for l in labels]
rows = [r for r in rows if r.get("verifyd", "this") == "this"]
graph = [r for r in rows if r.get("graph")]
eager = {key(r): r for r in rows if not r.get("graph") and "eager_p50_us" in r}
cxx = {(r["mps"], tuple(r["shape"])): r for r in rows if r.get("client") == "c++"}
print(f"# Serving-stack step with verifyd (commit {sys.argv[2]}, H200)\n")
print("Captured CUDA graph of a 61-layer step (stand-in GEMM + one verify call per layer through a "
      "doorbell channel), medians of 30 replays. Kernel = the served path's device time per call "
      "as verifyd measured it. Overhead/call = (step - step without - 61 x kernel) / 61.\n")
print("| MPS | mode | B,T,H,prefix | step ms | without ms | kernel ms/call | overhead us/call | "
      "eager p50 us | C++ client p50 us | eager - C++ us |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
for r in graph:
    e = eager.get(key(r), {})
    c = cxx.get((r["mps"], tuple(r["shape"])), {})
    ep, cp = e.get("eager_p50_us"), c.get("cxx_p50_us")
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"
    print(f"| {'yes' if r['mps'] else 'no'} | {r['mode']} | {','.join(map(str, r['shape']))} | "
          f"{r['step_ms']:.3f} | {r['step_ms_without']:.3f} | {r['kernel_ms_per_call']:.4f} | "
          f"{r['per_call_overhead_us']:.1f} | {fmt(ep)} | {fmt(cp)} | "
          f"{fmt(None if ep is None or cp is None else ep - cp)} |")
if any(bases):
    print("\nAgainst the baseline builds, each measured right after this one in the same run and "
          "MPS setting: overhead per call, microseconds.\n")
    for i, n in enumerate(names):
        print(f"- baseline {i + 1}: {n}")
    print("\n| MPS | mode | B,T,H,prefix | this us/call | "
          + " | ".join(f"baseline {i + 1} us/call | this / baseline {i + 1}" for i in range(len(names)))
          + " |")
    print("|---|---|---|---:|" + "---:|---:|" * len(names))
    for r in graph:
        cells = []
        for b in bases:
            o = b.get(key(r))
            cells += ["-", "-"] if o is None else [
                f"{o['per_call_overhead_us']:.1f}",
                f"{r['per_call_overhead_us'] / o['per_call_overhead_us']:.2f}"]
        print(f"| {'yes' if r['mps'] else 'no'} | {r['mode']} | {','.join(map(str, r['shape']))} | "
              f"{r['per_call_overhead_us']:.1f} | " + " | ".join(cells) + " |")
print("\nverifyd's host time in the last call of each step, microseconds (Timing: decode = "
      "parse and validate; prepare = staging and the checks of page ids and mask; "
      "served = the served path, for custom up to its output checked finite and written to o; "
      "fetch = waiting for the reference and writing o):\n")
print("| MPS | mode | B,T,H,prefix | decode | prepare | served | fetch | total |")
print("|---|---|---|---:|---:|---:|---:|---:|")
for r in graph:
    st = r.get("server_stages_us", {})
    print(f"| {'yes' if r['mps'] else 'no'} | {r['mode']} | {','.join(map(str, r['shape']))} | "
          + " | ".join(str(st.get(k, "-")) for k in ("decode", "prepare", "served", "fetch", "total"))
          + " |")
PY
cat "$OUT/stack.md"
exit $status
