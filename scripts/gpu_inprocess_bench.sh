#!/usr/bin/env bash
# The in-process benchmark on the GPU machine (bench/inprocess_bench.py): the custom kernel served
# inside a torch process (called directly and under the switch) against FlashMLA's dense decode
# and verifyd's doorbell, without MPS and then with verifyd and the benchmark as clients of one
# MPS control daemon (quit in a trap). FlashMLA is the pack's flashmla/flashmla_dense.so when
# there is one (FLASHMLA_SO overrides), else built first from the pack's flashmla/ sources
# (bench/flashmla_peer/prepare.sh) into OUT/flashmla/, which comes back to carry next time.
# Writes OUT/inprocess.json (one row per line) and OUT/inprocess.md.
#
#   gpu_inprocess_bench.sh PACK_DIR OUT_DIR     (INPROCESS_BENCH_ARGS: more arguments)
set -uo pipefail
PACK=$1 OUT=$2
# shellcheck source=gpu_stack_env.sh
source "$(dirname "$0")/gpu_stack_env.sh"
mkdir -p "$OUT"
export VERIFYD_KERNEL_LIB=$PACK/lib/libverifyd_kernel.so VERIFYD_BIN=$PACK/bin/verifyd
so=${FLASHMLA_SO:-$PACK/flashmla/flashmla_dense.so}
if [[ ! -f $so ]]; then
  start=$(date +%s)
  python3 "$PACK/flashmla/build.py" "$PACK/flashmla" "$OUT/flashmla" > "$OUT/flashmla_build.log" 2>&1 ||
    { echo "FAIL FlashMLA build: $(tail -5 "$OUT/flashmla_build.log")"; exit 1; }
  so=$OUT/flashmla/flashmla_dense.so
  echo "FlashMLA built in $(( $(date +%s) - start )) s"
fi
rows=$OUT/inprocess.json
: > "$rows"
for mps in 0 1; do
  if [[ $mps == 1 ]]; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$mps_ctl" -d || { echo "FAIL MPS did not start"; status=1; break; }
  fi
  # shellcheck disable=SC2086
  timeout 280 python3 "$PACK/py/bench/inprocess_bench.py" --flashmla "$so" --mps "$mps" \
    --out "$rows" ${INPROCESS_BENCH_ARGS:-} > "$OUT/inprocess_mps$mps.txt" 2>&1 ||
    { echo "FAIL inprocess_bench.py (mps $mps): $(tail -3 "$OUT/inprocess_mps$mps.txt")"; status=1; }
  [[ $mps == 1 ]] && quit_mps
done
python3 "$PACK/py/bench/inprocess_report.py" "$rows" "$(cat "$PACK/COMMIT" 2>/dev/null)" \
  > "$OUT/inprocess.md"
cat "$OUT/inprocess.md"
exit $status
