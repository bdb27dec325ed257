#!/usr/bin/env bash
# Shadow taps on the GPU machine: the graph test with a planted bug in the stack's own attention
# (tests/python/gpu_tap_test.py), on a bf16 pool and on an e4m3 one, then the cost of taps to a
# captured 61-layer step at sample rates 0, 1% and 100%, the step with verifyd stopped, and a long
# run in which every tap must be accounted for (bench/tap_bench.py), with the shipped
# libverifyd_tap.so (the copy that keeps four loads in flight per thread). When the pack has
# libverifyd_tap_one_load.so (the copy before it, one load in flight), the cost again with that
# one, beside it: the rates and one tap alone only (under a minute more); then those with the
# shipped copy on e4m3 pools (half the KV bytes). Writes OUT/tap.json (one row per line, each
# with its copy, wide or one_load, and its kv_dtype), OUT/tap.md and the logs.
#
#   gpu_tap_bench.sh PACK_DIR OUT_DIR     (TAP_BENCH_ARGS: more arguments for tap_bench.py)
set -uo pipefail
PACK=$1 OUT=$2
bin=$PACK/bin
dir=$(mktemp -d)
mkdir -p "$OUT"
rows=$OUT/tap.json
: > "$rows"
export VERIFYD_CLIENT_GEN=$PACK/py/gen VERIFYD_TAP_LIB=$PACK/lib/libverifyd_tap.so
export LD_LIBRARY_PATH="$PACK/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
trap 'kill -CONT $(jobs -p) 2>/dev/null; kill $(jobs -p) 2>/dev/null || true' EXIT
status=0

start_verifyd() {  # $1: a tag for the log
  rm -rf "$dir/state" "$dir"/*.sock
  "$bin/verifyd" --engine=cuda --listen="unix:$dir/verifyd.sock" \
    --admin_listen="unix:$dir/admin.sock" --metrics_address=127.0.0.1:0 \
    --state_dir="$dir/state" --capture_dir=off --log_level=warn > "$OUT/tap_verifyd_$1.log" 2>&1 &
  vpid=$!
  for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && return 0; sleep 0.1; done
  echo "FAIL verifyd did not start ($1)"; status=1; return 1
}

if start_verifyd test; then
  for kv in bf16 e4m3; do  # the second on an fp8 pool: the tap copies e4m3 pages and their scale
    timeout 300 python3 "$PACK/py/tests/python/gpu_tap_test.py" --data "unix://$dir/verifyd.sock" \
      --admin "unix://$dir/admin.sock" --verifyd_log "$OUT/tap_verifyd_test.log" --kv_dtype $kv \
      > "$OUT/tap_test_$kv.txt" 2>&1 ||
      { echo "FAIL gpu_tap_test.py --kv_dtype $kv: $(tail -3 "$OUT/tap_test_$kv.txt")"; status=1; }
  done
  kill "$vpid"; wait "$vpid" 2>/dev/null
fi
if start_verifyd bench; then
  timeout 400 python3 "$PACK/py/bench/tap_bench.py" --data "unix://$dir/verifyd.sock" \
    --admin "unix://$dir/admin.sock" --verifyd_pid "$vpid" --out "$rows" ${TAP_BENCH_ARGS:-} \
    > "$OUT/tap_bench.txt" 2>&1 || { echo "FAIL tap_bench.py: $(tail -3 "$OUT/tap_bench.txt")"; status=1; }
  kill "$vpid"; wait "$vpid" 2>/dev/null
fi
one_load=$PACK/lib/libverifyd_tap_one_load.so
if [[ -e $one_load ]] && start_verifyd bench_one_load; then
  VERIFYD_TAP_LIB=$one_load timeout 120 python3 "$PACK/py/bench/tap_bench.py" \
    --data "unix://$dir/verifyd.sock" --admin "unix://$dir/admin.sock" --verifyd_pid "$vpid" \
    --out "$rows" --copy one_load --cost_only ${TAP_BENCH_ARGS:-} > "$OUT/tap_bench_one_load.txt" 2>&1 ||
    { echo "FAIL tap_bench.py (one_load): $(tail -3 "$OUT/tap_bench_one_load.txt")"; status=1; }
  kill "$vpid"; wait "$vpid" 2>/dev/null
fi

# The shipped copy on e4m3 pools (one byte an element): the rates and one tap alone.
if start_verifyd bench_e4m3; then
  timeout 120 python3 "$PACK/py/bench/tap_bench.py" --data "unix://$dir/verifyd.sock" \
    --admin "unix://$dir/admin.sock" --verifyd_pid "$vpid" --out "$rows" --kv_dtype e4m3 \
    --cost_only ${TAP_BENCH_ARGS:-} > "$OUT/tap_bench_e4m3.txt" 2>&1 ||
    { echo "FAIL tap_bench.py (e4m3): $(tail -3 "$OUT/tap_bench_e4m3.txt")"; status=1; }
  kill "$vpid"; wait "$vpid" 2>/dev/null
fi

python3 - "$rows" "$(cat "$PACK/COMMIT" 2>/dev/null)" > "$OUT/tap.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    r.setdefault("copy", "wide")
    if r.get("kv_dtype", "bf16") == "e4m3":  # the shipped copy on an e4m3 pool
        r["copy"] += " e4m3"
shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
def order(r):  # a shape's rows by rate, the copies of each side by side (the sort is stable)
    return shapes.index(tuple(r["shape"])), r.get("sample_rate", 0)
print(f"# Shadow taps in a serving-stack step (commit {sys.argv[2]}, H200)\n")
print("Captured CUDA graph of a 61-layer step (stand-in GEMM + one tap per layer), medians of "
      "the replays. per call = (step - step without taps) / 61. At 100% the ring (4 slots) takes "
      "what verifyd has handed back; the other sampled calls are dropped. per copied call = "
      "(step - step at rate 0) / fills per step, where fills outnumber drops; target 10 us + "
      "bytes / 3 TB/s. The copy alone is measured below. copy: wide is the shipped "
      "libverifyd_tap.so (four 16-byte loads in flight per thread, streaming loads and stores, a "
      "warp per four tokens), one_load the baseline libverifyd_tap_one_load.so (one in flight), "
      "each timed with its own verifyd.\n")
print("| B,T,H,prefix | copy | sample rate | step ms | without ms | per call us | fills/step | "
      "drops/step | MB/fill | per copied call us | target us |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in sorted((r for r in rows if "sample_rate" in r and "step_ms" in r), key=order):
    print(f"| {','.join(map(str, r['shape']))} | {r['copy']} | {r['sample_rate']:g} | "
          f"{r['step_ms']:.3f} | {r['step_ms_without']:.3f} | {r['per_call_cost_us']:.2f} | "
          f"{r['fills_per_step']:.2f} | {r['drops_per_step']:.2f} | "
          f"{r['bytes_per_fill'] / 1e6:.2f} | {r.get('cost_per_fill_us', float('nan')):.1f} | "
          f"{r.get('target_per_fill_us', float('nan')):.1f} |")
ones = sorted((r for r in rows if r.get("one_tap")), key=order)
if ones:
    base = {tuple(r["shape"]): r["copy_us"] for r in ones if r["copy"] == "one_load"}
    print("\nOne tap alone on the stream (events around it, the ring drained first), medians: a "
          "copied call against an unsampled one; the difference is the copy. wide / one_load: "
          "the shipped copy's time over the baseline's, in this run.\n")
    print("| B,T,H,prefix | copy | MB copied | copied us | unsampled us | copy us | target us | "
          "wide / one_load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in ones:
        b = base.get(tuple(r["shape"]))
        ratio = f"{r['copy_us'] / b:.2f}" if r["copy"] == "wide" and b else ""
        print(f"| {','.join(map(str, r['shape']))} | {r['copy']} | "
              f"{r['bytes_per_fill'] / 1e6:.2f} | {r['copied_tap_us']:.1f} | "
              f"{r['unsampled_tap_us']:.1f} | {r['copy_us']:.1f} | {r['target_per_fill_us']:.1f} | "
              f"{ratio} |")
for r in rows:
    if r.get("stopped"):
        print(f"\nverifyd stopped (SIGSTOP), rate 100%: step {r['step_ms_stopped']:.3f} ms against "
              f"{r['step_ms_running']:.3f} ms running and {r['step_ms_without']:.3f} ms without "
              f"taps; {r['dropped_while_stopped']} calls dropped and counted.")
    if r.get("long_run"):
        t = r["totals"]
        print(f"\nLong run at 100%: {t['calls']} tap calls in {r['seconds']:.1f} s; taps {t['taps']}"
              f" = compared {t['compared']} + refused {t['refused']} + dropped {t['dropped']}: "
              f"{'accounted' if t['accounted'] else 'NOT ACCOUNTED'}.")
PY
exit $status
