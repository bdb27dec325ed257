#!/usr/bin/env bash
# Runs on the GPU machine from a folder made by gpu_pack.sh: the kernel, CUDA-engine and service
# suites (the daemon on --engine=cuda over gRPC), `verifyctl replay` of the golden cases on the
# CUDA engine, compute-sanitizer memcheck, racecheck and synccheck over small grids,
# verifyd-bench and the service benchmark. Writes into OUT_DIR: tests.log, tests.json (gtest),
# memcheck.log, racecheck.log, synccheck.log, bench.log, <date>-<commit>-<device>.{md,json},
# service-<commit>.{md,json}, summary.txt (printed last). With --mutants (a pack made with
# VERIFYD_PACK_MUTANTS) also the CUDA mutation suite: <date>-<commit>-cuda-mutation.{md,json},
# mutation.log and mutation-drivers.tgz (the drivers' JSON); --clean-calls N adds about N clean
# calls to it.
#
#   gpu_run.sh OUT_DIR [--skip-tests] [--skip-memcheck] [--skip-bench] [--skip-service]
#                      [--bench-args "..."] [--kernel-filter GTEST_FILTER]
#                      [--mutants] [--clean-calls N]
set -uo pipefail

PACK=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: gpu_run.sh OUT_DIR [--skip-tests] [--skip-memcheck] [--skip-bench]}
shift
run_tests=1 run_memcheck=1 run_bench=1 run_service=1 bench_args="" kernel_filter_arg=""
run_mutants=0 clean_calls=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --skip-tests) run_tests=0 ;;
    --skip-memcheck) run_memcheck=0 ;;
    --skip-bench) run_bench=0 ;;
    --skip-service) run_service=0 ;;
    --kernel-filter) kernel_filter_arg=$2; shift ;;
    --bench-args) bench_args=$2; shift ;;
    --mutants) run_mutants=1 ;;
    --clean-calls) clean_calls=$2; shift ;;
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
if [[ $run_mutants == 1 ]]; then
  if [[ -x $PACK/mutation/run_cuda_mutants.sh && -d $PACK/mutants ]]; then
    start=$(date +%s)
    timeout "${VERIFYD_MUTANTS_TIMEOUT:-540}" "$PACK/mutation/run_cuda_mutants.sh" \
      --drivers "$PACK/mutants" --out "$OUT" --clean_calls "$clean_calls" > "$OUT/mutation.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "CUDA mutation suite: rc=$rc in $(( $(date +%s) - start )) s ($(tail -n 1 "$OUT/mutation.log"))" \
      >> "$SUMMARY"
  else
    echo "CUDA mutation suite: not in this pack (VERIFYD_PACK_MUTANTS)" >> "$SUMMARY"
    status=1
  fi
fi
# The shipped Hopper variant first, alone, on the small grid: a fault there (a sticky CUDA
# error) must not take the other configurations' results or the benchmark down with it.
shipped_ok=1
if [[ $run_tests == 1 || $run_bench == 1 ]]; then
  timeout 120 "$PACK/bin/test_custom_kernel" --gtest_filter='Small/*__hopper' \
    > "$OUT/probe.txt" 2>&1 || shipped_ok=0
  echo "probe of the shipped Hopper variant (Small/*__hopper): ok=$shipped_ok" >> "$SUMMARY"
fi

if [[ $run_tests == 1 ]]; then
  # The shipped kernels (v5t and the split combine) hold no call: a device-runtime call in a kernel
  # with wgmma makes ptxas serialise every wgmma in it (kernels/NOTES.md, "The checks inside the
  # kernel"). The toolkit's cuobjdump reads it from the op's library.
  cuobjdump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  if [[ -x $cuobjdump && -e $PACK/lib/libverifyd_kernel.so ]]; then
    v5t='_ZN7verifyd7kernels6custom16PairSeesawKernelINS1_10TileConfigILi64ELi64ELi2EEELb0ELb1EEEvNS1_12KernelParamsE'
    calls=$("$cuobjdump" -sass -fun "$v5t" "$PACK/lib/libverifyd_kernel.so" 2>&1 | grep -c ' CALL')
    [[ $calls == 0 ]] || status=1
    echo "calls in the shipped kernel's SASS (0 expected): $calls" >> "$SUMMARY"
  fi
  : > "$OUT/tests.log"
  cat "$OUT/probe.txt" >> "$OUT/tests.log"
  rm -f "$OUT/probe.txt"
  kernel_filter=${kernel_filter_arg:-*}
  [[ $shipped_ok == 1 ]] || kernel_filter='-*__hopper:*__hopper_split5:CustomKernelDeterminism.*'
  # The service suites start verifyd in-process on the CUDA engine.
  export VERIFYD_TEST_ENGINE=cuda
  for t in test_custom_plan test_custom_kernel_golden test_custom_kernel test_custom_kernel_checks \
           test_reference_kernels test_cuda_engine test_cuda_sticky_error test_service; do
    [[ -x "$PACK/bin/$t" ]] || continue
    filter='*'
    [[ $t == test_custom_kernel ]] && filter=$kernel_filter
    # The service suites that reach the engine, its regions and its channels (the others are
    # the CPU machine's).
    [[ $t == test_service ]] && filter='EndToEndTest.*:CaptureTest.*:RegionTest.*:RegionChild.*:ShmMapping.*:ChannelTest.*:ChannelChild.*:ChannelLayout.*:ChannelSpin.*:DoorbellTest.*:DoorbellChild.*:DoorbellLayout.*:ReceiveService.*:ProbeServiceTest.*:DriftServiceTest.*'
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
  # Region transports across two processes (verifyd and verifyctl), the shadow hazard, and the
  # replay of a captured region call.
  timeout 300 "$PACK/gpu_region_test.sh" "$PACK" "$OUT" > "$OUT/region_test.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "gpu_region_test.sh: rc=$rc" >> "$SUMMARY"
  grep -E "^(FAIL|shadow comparisons)" "$OUT/region_test.txt" >> "$SUMMARY"
  # SGLang's backend adapters on CUDA tensors: the conversion makes no host synchronisation and
  # is captured in a CUDA graph; each adapter's eager call goes through verifyd (CUDA engine).
  gen=$PACK/py/gen
  if python3 -c "import grpc_tools" 2>/dev/null; then
    adapters_gen=$(mktemp -d)
    python3 -m grpc_tools.protoc -I"$PACK/py/proto" --python_out="$adapters_gen" \
      --grpc_python_out="$adapters_gen" "$PACK"/py/proto/verifyd/v1/*.proto && gen=$adapters_gen
  fi
  VERIFYD_BIN="$PACK/bin/verifyd" VERIFYD_CLIENT_GEN=$gen timeout 300 \
    python3 "$PACK/py/tests/python/test_adapters.py" > "$OUT/adapters.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "adapters: rc=$rc ($(tail -n 1 "$OUT/adapters.txt"))" >> "$SUMMARY"
  grep -E "^(FAIL|ERROR):" "$OUT/adapters.txt" | head -10 >> "$SUMMARY"
  # The custom kernel in the serving process (libverifyd_kernel.so): against the fp64 oracle,
  # eager and captured, e4m3 pools, its device checks on bad calls (in the kernel and around
  # it), and its cost in a 61-layer step (both placements of the checks side by side).
  if [[ -e $PACK/lib/libverifyd_kernel.so ]]; then
    VERIFYD_KERNEL_LIB="$PACK/lib/libverifyd_kernel.so" VERIFYD_CLIENT_GEN=$gen timeout 480 \
      python3 "$PACK/py/tests/python/gpu_kernel_op_test.py" --json "$OUT/kernel_op.json" \
      --md "$OUT/kernel_op.md" --commit "$COMMIT" > "$OUT/kernel_op.txt" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "gpu_kernel_op_test.py: rc=$rc ($(tail -n 1 "$OUT/kernel_op.txt"))" >> "$SUMMARY"
    grep -E "^(FAIL|bench)" "$OUT/kernel_op.txt" | head -20 >> "$SUMMARY"
    # The switch under a real verifyd: flip, rollback, verifyd stopped and killed.
    VERIFYD_BIN="$PACK/bin/verifyd" VERIFYD_KERNEL_LIB="$PACK/lib/libverifyd_kernel.so" \
      VERIFYD_CLIENT_GEN=$gen timeout 300 \
      python3 "$PACK/py/tests/python/gpu_switch_verifyd_test.py" --json "$OUT/switch_verifyd.json" \
      > "$OUT/switch_verifyd.txt" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "gpu_switch_verifyd_test.py: rc=$rc ($(tail -n 1 "$OUT/switch_verifyd.txt"))" >> "$SUMMARY"
    grep -E "^FAIL" "$OUT/switch_verifyd.txt" | head -20 >> "$SUMMARY"
  fi
  # The probe suite at its CUDA size (128K prefixes): result and share of GPU time.
  timeout 400 "$PACK/gpu_probe_cost.sh" "$PACK" "$OUT" > "$OUT/probe_cost.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "gpu_probe_cost.sh: rc=$rc" >> "$SUMMARY"
  grep -E "^(FAIL|ok)" "$OUT/probe_cost.txt" >> "$SUMMARY"
  # The golden cases through every path of the CUDA engine, as an operator would replay them.
  "$PACK/bin/verifyctl" replay --engine cuda "$PACK"/data/golden/*.safetensors \
    > "$OUT/replay_golden.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "verifyctl replay --engine cuda (golden): rc=$rc" >> "$SUMMARY"
  grep -E "golden (reference|custom|oracle)" "$OUT/replay_golden.txt" |
    awk '{print $2, $4}' | sort | awk '{m[$1] = ($2 > m[$1] ? $2 : m[$1])}
      END {for (p in m) print "  worst golden rel-L2 " p ": " m[p]}' >> "$SUMMARY"
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
  # The kernels' shared-memory handoffs (barriers, named-barrier arrive/wait) over the same grid.
  for tool in racecheck synccheck; do
    start=$(date +%s)
    timeout "${VERIFYD_MEMCHECK_TIMEOUT:-200}" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$PACK/bin/test_custom_kernel" --gtest_filter='Small/*' > "$OUT/$tool.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "$tool (Small/*): rc=$rc in $(( $(date +%s) - start )) s;" \
      "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)" >> "$SUMMARY"
  done
  start=$(date +%s)
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$PACK/bin/test_cuda_engine" \
    --gtest_filter='FaultInjection.*:Cases/Golden.*tree_odd*:CudaEngine.Refuses*' \
    >> "$OUT/memcheck.log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "memcheck (CUDA engine subset): rc=$rc in $(( $(date +%s) - start )) s;" \
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
  # One call's engine steps without a transport: reference, shadow, shadow waited for.
  if [[ -x "$PACK/bin/verifyd-engine-bench" ]]; then
    timeout 120 "$PACK/bin/verifyd-engine-bench" --engine cuda --commit "$COMMIT" --out "$OUT" \
      > "$OUT/engine_bench.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || status=1
    echo "verifyd-engine-bench: rc=$rc" >> "$SUMMARY"
    [[ -f "$OUT/engine-bench-cuda.md" ]] && cat "$OUT/engine-bench-cuda.md" >> "$SUMMARY"
  fi
fi
if [[ $run_service == 1 ]]; then
  start=$(date +%s)
  # Six transports x 2 shapes x 2 concurrencies x 4 runs, the finite check and the floor rows:
  # about 400 s on the H200 at 150 calls per row (four transports took 330 s at 200).
  timeout "${VERIFYD_SERVICE_TIMEOUT:-560}" "$PACK/gpu_service_bench.sh" "$PACK" "$OUT" \
    "${VERIFYD_SERVICE_COUNT:-150}" > "$OUT/service.log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "service benchmark: rc=$rc in $(( $(date +%s) - start )) s" >> "$SUMMARY"
  md=$(ls "$OUT"/service-*.md 2>/dev/null | head -1)
  [[ -n "$md" ]] && cat "$md" >> "$SUMMARY"
fi
cat "$SUMMARY"
exit $status
