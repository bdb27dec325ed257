#!/usr/bin/env bash
# Runs on the GPU machine from a folder made by gpu_pack.sh (with VERIFYD_PACK_MUTANTS): the
# invariance probes' GPU suite (test_custom_invariance), the CUDA engine's suite, the cost of the
# invariance probes through the CUDA engine (the fast subset and the full sweep, timed by the
# clean mutation driver), and the CUDA mutation suite over the drivers in the pack. Writes into
# OUT_DIR: invariance.log, cuda_engine.log, invariance-cost.log, mutation.log, the matrix
# (<date>-<commit>-cuda-mutation.{md,json}), mutation-drivers.tgz and summary.txt (printed last).
#
#   gpu_invariance_run.sh OUT_DIR [--only a,b,...] [--mutation-timeout S]
# Without --only, the mutation suite runs the mutants whose drivers are in the pack.
set -uo pipefail

PACK=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: gpu_invariance_run.sh OUT_DIR [--only a,b] [--mutation-timeout S]}
shift
only="" mutation_timeout=420
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only=$2; shift ;;
    --mutation-timeout) mutation_timeout=$2; shift ;;
    *) echo "gpu_invariance_run: unknown option $1" >&2; exit 2 ;;
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
} >"$SUMMARY"
status=0
step() {  # step NAME TIMEOUT LOG COMMAND...: runs it, one line in the summary
  local name=$1 limit=$2 log=$3 t0=$SECONDS rc
  shift 3
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  [[ $rc == 0 ]] || status=1
  echo "$name: rc=$rc in $((SECONDS - t0)) s" >>"$SUMMARY"
}

step test_custom_invariance 300 "$OUT/invariance.log" "$PACK/bin/test_custom_invariance"
grep -E "^\[  (PASSED|FAILED) " "$OUT/invariance.log" >>"$SUMMARY"
if [[ -x $PACK/bin/test_cuda_engine ]]; then
  step test_cuda_engine 180 "$OUT/cuda_engine.log" "$PACK/bin/test_cuda_engine"
fi

# What the probes cost through the CUDA engine: the periodic subset and the full sweep, on the
# cases sized for the CUDA engine's probe suite (64K), with the clean kernel.
drv=$PACK/mutants/mutant_driver.clean
if [[ -x $drv ]]; then
  : >"$OUT/invariance-cost.log"
  for sweep in fast full; do
    flag=()
    [[ $sweep == fast ]] && flag=(--invariance_fast)
    for rep in 1 2; do
      timeout 120 "$drv" --engine cuda --traffic random --prefixes 64 --pages 64 --drafts 4 \
        --calls 1 --invariance_max_prefix 65536 "${flag[@]}" \
        --json "$OUT/invariance-cost-$sweep-$rep.json" >>"$OUT/invariance-cost.log" 2>&1 ||
        status=1
    done
  done
  grep "invariance:" "$OUT/invariance-cost.log" >>"$SUMMARY"
  tar czf "$OUT/invariance-cost.tgz" -C "$OUT" $(cd "$OUT" && ls invariance-cost-*.json)
  rm -f "$OUT"/invariance-cost-*.json
fi

if [[ -x $PACK/mutation/run_cuda_mutants.sh ]]; then
  args=(--drivers "$PACK/mutants" --out "$OUT")
  if [[ -z $only ]]; then  # the mutants whose drivers the pack holds, not the suite's whole list
    only=$(cd "$PACK/mutants" && ls mutant_driver.* | sed 's/^mutant_driver\.//' | grep -vx clean |
      paste -sd, -)
  fi
  [[ -n $only ]] && args+=(--only "$only")
  step "CUDA mutation suite" "$mutation_timeout" "$OUT/mutation.log" \
    "$PACK/mutation/run_cuda_mutants.sh" "${args[@]}"
  grep -E "^(drivers ran|wrote|FAIL)" "$OUT/mutation.log" >>"$SUMMARY"
fi
cat "$SUMMARY"
exit $status
