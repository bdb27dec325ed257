#!/usr/bin/env bash
# Runs the packed GPU suites (pack_gpu_tests.sh) on the GPU machine, from the repository root.
# Logs go to $OUT when set, else .gpu/cuda/logs. Exit status: non-zero when any suite failed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/logs}
mkdir -p "$out"
export LD_LIBRARY_PATH=$here/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export VERIFYD_TEST_DATA=${VERIFYD_TEST_DATA:-$PWD/tests/data}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  nproc
} >"$out/device.txt" 2>&1
cat "$out/device.txt"

rc=0
run() {  # name, time limit in seconds, extra arguments
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$here/$name" "$@" >"$out/$name.log" 2>&1
  local r=$?
  echo "== $name: exit $r in $((SECONDS - start)) s"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |tests? ran|worst|chunked|^engine cuda|^warm|context' \
    "$out/$name.log" | head -80
  [ "$r" -ne 0 ] && rc=1
  return 0
}
run test_reference_kernels 60
run test_cuda_sticky_error 60
run test_cuda_engine 180
if command -v compute-sanitizer >/dev/null && [ "${VERIFYD_SANITIZE_GPU:-1}" = 1 ]; then
  start=$SECONDS
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$here/test_reference_kernels" --gtest_filter='ReferenceKernel.*:OracleKernel.*:CompareKernel.*' \
    >"$out/memcheck.log" 2>&1
  r=$?
  echo "== memcheck test_reference_kernels: exit $r in $((SECONDS - start)) s"
  tail -3 "$out/memcheck.log"
  [ "$r" -ne 0 ] && rc=1
  start=$SECONDS
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 \
    "$here/test_reference_kernels" --gtest_filter='ReferenceKernel.Chunking*:CompareKernel.*' \
    >"$out/racecheck.log" 2>&1
  r=$?
  echo "== racecheck test_reference_kernels: exit $r in $((SECONDS - start)) s"
  tail -3 "$out/racecheck.log"
  [ "$r" -ne 0 ] && rc=1
  start=$SECONDS
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$here/test_cuda_engine" \
    --gtest_filter='FaultInjection.*:Cases/Golden.*tree_odd*:CudaEngine.Refuses*' \
    >"$out/memcheck_engine.log" 2>&1
  r=$?
  echo "== memcheck test_cuda_engine (subset): exit $r in $((SECONDS - start)) s"
  tail -3 "$out/memcheck_engine.log"
  [ "$r" -ne 0 ] && rc=1
fi
exit $rc
