#!/usr/bin/env bash
# Runs on the GPU machine from a folder made by gpu_pack.sh: the GPU test suites, a
# compute-sanitizer memcheck over the small grid, and verifyd-bench. Writes into OUT_DIR:
#   tests.log, tests.json (gtest), memcheck.log, bench.log, <date>-<commit>-<device>.{md,json},
#   summary.txt (also printed last). probe.txt only when the tests are skipped.
#
#   gpu_run.sh OUT_DIR [--skip-tests] [--skip-memcheck] [--skip-bench] [--bench-args "..."]
set -uo pipefail

PACK=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: gpu_run.sh OUT_DIR [--skip-tests] [--skip-memcheck] [--skip-bench]}
shift
run_tests=1 run_memcheck=1 run_bench=1 bench_args=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --skip-tests) run_tests=0 ;;
    --skip-memcheck) run_memcheck=0 ;;
    --skip-bench) run_bench=0 ;;
    --bench-args) bench_args=$2; shift ;;
    *) echo "gpu_run: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PACK/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export VERIFYD_TEST_DATA="$PACK/data"
COMMIT=$(cat "$PACK/COMMIT" 2>/dev/null || echo unknown)
SUMMARY="$OUT/summary.txt"
{
  echo "commit $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv,noheader 2>&1
} > "$SUMMARY"

status=0
# The shipped Hopper variant first, alone, on the small grid: a fault there (a sticky CUDA
# error) must not take the other configurations' results or the benchmark down with it.
shipped_ok=1
if [[ $run_tests == 1 || $run_bench == 1 ]]; then
  timeout 120 "$PACK/bin/test_custom_kernel" --gtest_filter='Small/*__hopper' \
    > "$OUT/probe.txt" 2>&1 || shipped_ok=0
  echo "probe of the shipped Hopper variant (Small/*__hopper): ok=$shipped_ok" >> "$SUMMARY"
fi

if [[ $run_tests == 1 ]]; then
  : > "$OUT/tests.log"
  cat "$OUT/probe.txt" >> "$OUT/tests.log"
  rm -f "$OUT/probe.txt"
  kernel_filter='*'
  [[ $shipped_ok == 1 ]] || kernel_filter='-*__hopper:*__hopper_split5:CustomKernelDeterminism.*'
  for t in test_custom_plan test_custom_kernel_golden test_custom_kernel; do
    [[ -x "$PACK/bin/$t" ]] || continue
    filter='*'
    [[ $t == test_custom_kernel ]] && filter=$kernel_filter
    start=$(date +%s)
    timeout "${VERIFYD_TEST_TIMEOUT:-300}" "$PACK/bin/$t" --gtest_filter="$filter" \
      --gtest_output="json:$OUT/$t.json" >> "$OUT/tests.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "$t ($filter): rc=$rc in $(( $(date +%s) - start )) s" >> "$SUMMARY"
  done
  # One JSON file for all suites keeps the returned files few.
  python3 - "$OUT" <<'PY' >> "$SUMMARY" 2>&1
import glob, json, os, re, sys, collections
out = sys.argv[1]
merged, by_cfg = [], collections.defaultdict(lambda: [0, 0, 0])
for f in sorted(glob.glob(os.path.join(out, "test_*.json"))):
    j = json.load(open(f))
    merged.append(j)
    for suite in j.get("testsuites", []):
        for t in suite.get("testsuite", []):
            name = t["name"]
            m = re.search(r"__(\w+)$", name)
            cfg = m.group(1) if m else suite["name"]
            skipped = t.get("result") == "SKIPPED"
            failed = bool(t.get("failures"))
            by_cfg[cfg][2 if skipped else (1 if failed else 0)] += 1
    os.remove(f)
json.dump(merged, open(os.path.join(out, "tests.json"), "w"), indent=1)
print("tests by configuration (passed / failed / skipped):")
for cfg, (p, fl, s) in sorted(by_cfg.items()):
    print(f"  {cfg:28s} {p:4d} {fl:4d} {s:4d}")
PY
  grep -E "^\[  FAILED  \]" "$OUT/tests.log" | sort -u | head -40 >> "$SUMMARY"
fi

if [[ $run_memcheck == 1 ]]; then
  start=$(date +%s)
  timeout "${VERIFYD_MEMCHECK_TIMEOUT:-200}" \
    compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \
    "$PACK/bin/test_custom_kernel" --gtest_filter='Small/*' > "$OUT/memcheck.log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "memcheck (Small/*): rc=$rc in $(( $(date +%s) - start )) s;" \
    "$(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)" >> "$SUMMARY"
fi

if [[ $run_bench == 1 ]]; then
  start=$(date +%s)
  if [[ $shipped_ok != 1 && -z "$bench_args" ]]; then
    bench_args="--paths custom-qkwgmma custom-mma custom-sm120cfg reference"
  fi
  # shellcheck disable=SC2086
  timeout "${VERIFYD_BENCH_TIMEOUT:-300}" "$PACK/bin/verifyd-bench" --out "$OUT" \
    --commit "$COMMIT" $bench_args > "$OUT/bench.log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "verifyd-bench: rc=$rc in $(( $(date +%s) - start )) s" >> "$SUMMARY"
  md=$(ls "$OUT"/*-"$COMMIT"-*.md 2>/dev/null | head -1)
  [[ -n "$md" ]] && cat "$md" >> "$SUMMARY"
fi
cat "$SUMMARY"
exit $status
