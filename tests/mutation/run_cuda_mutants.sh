#!/usr/bin/env bash
# The CUDA mutation suite, on the GPU machine: runs the drivers build_cuda_mutants.sh built (the
# clean kernel and one per planted bug in tests/mutation/cuda_patches/) on the CUDA engine over
# the shape classes and traffic models, --jobs processes at a time sharing the GPU, and writes the
# detection matrix (markdown + JSON), keeping the drivers' JSON and logs beside it
# (mutation-drivers.tgz). With --clean_calls N the clean driver also runs about N
# more calls over every shape class (most at short prefixes, where calls are cheap), each fed to
# the oracle drift test: the false-breach count of the per-call check and of drift.
#
#   run_cuda_mutants.sh --drivers DIR [--out DIR] [--jobs N] [--clean_calls N] [--only a,b]
#                       [--smoke] [-- extra mutant_driver arguments]
#
# --smoke: two tiny sets of classes (a rehearsal of the script; with VERIFYD_MUTANT_ENGINE=cpu it
# runs without a GPU, which is how CTest runs it).
# Exits 1 when the clean build breached, tripped drift, failed a probe or an invariance check, or
# when a mutant not in expected_cuda_survivors.txt went undetected on realistic traffic at some
# prefix.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
drivers=""
out=$root/bench/results
jobs=$(nproc)
clean_calls=0
only=""
smoke=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --drivers) drivers=$2; shift ;;
    --out) out=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    --clean_calls) clean_calls=$2; shift ;;
    --only) only=$2; shift ;;
    --smoke) smoke=1 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_cuda_mutants.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$drivers" ] || [ ! -x "$drivers/mutant_driver.clean" ]; then
  echo "run_cuda_mutants.sh: --drivers DIR with mutant_driver.clean (build_cuda_mutants.sh)" >&2
  exit 2
fi
engine=${VERIFYD_MUTANT_ENGINE:-cuda}  # cpu: a rehearsal of this script without a GPU
commit=$(cat "$drivers/commit" 2>/dev/null || echo unknown)
work=$(mktemp -d "${TMPDIR:-/tmp}/verifyd-cuda-mutants.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
mkdir -p "$work/json" "$work/log"

mutants=(clean)
for p in "$here"/cuda_patches/*.patch; do mutants+=("$(basename "$p" .patch)"); done
if [ -n "$only" ]; then  # clean always runs, once
  IFS=, read -r -a picked <<<"$only"
  mutants=(clean)
  for m in "${picked[@]}"; do [ "$m" = clean ] || mutants+=("$m"); done
fi

# Sets of classes, one driver run each per mutant. B = 1 plans many KV splits (the seesaw
# schedule); B = 16 at short prefixes plans fewer than 8 (the v3 schedule). The drift set is a
# stream long enough for the drift test's verdict; the first set also runs the probe suite, the
# determinism probe (the custom path 4 times on one random-valued bundle at a 32K prefix) and the
# invariance probes' full sweep (the custom path against itself, src/probe/invariance.h). The
# last two sets have the geometry of real traffic: ragged batches (each request's prefix off the
# tile by its own offset, so draft blocks start at every offset and straddle tiles), B and H that
# plan splits of several tiles. Then a draft block of 192 keys at B = 1, H = 2 (splits of two
# tiles, so a split that starts past the last prefix key holds two tiles of draft keys), and e4m3
# pools (the engine's dequantisation and the served output's kv_scale).
sets=("--prefixes 512,4096 --pages 1,64 --drafts 4,16,64 --calls 20 --budget 1e12 --probe_max_prefix 65536 --determinism_prefix 32768 --invariance_max_prefix 65536"
      "--prefixes 16384,65536 --pages 1,64 --drafts 4,16,64 --calls 3"
      "--batch 16 --prefixes 512,2048 --pages 1,64 --drafts 4,16 --calls 5"
      "--prefixes 512,4096 --pages 1,64 --drafts 4 --calls 12 --budget 1e12 --drift"
      "--batch 32 --heads 16 --ragged --prefixes 500,4033 --pages 1,64 --drafts 4,16 --calls 2"
      "--batch 8 --heads 16 --ragged --prefixes 1000,16065 --pages 64 --drafts 16 --calls 2"
      "--prefixes 700,1300 --pages 1,64 --drafts 192 --calls 3"
      "--prefixes 512,4033 --pages 1,64 --drafts 4,16 --calls 4 --kv_dtype e4m3 --kv_scale 0.37")
shares=("512 8500" "4096 1200" "16384 250" "65536 50")
if [ $smoke = 1 ]; then
  sets=("--prefixes 64 --pages 1,64 --drafts 4 --calls 1 --probe_max_prefix 256 --determinism_prefix 64 --invariance_max_prefix 256"
        "--prefixes 100 --pages 64 --drafts 4 --calls 2 --drift")
  shares=("64 8000" "200 2000")
fi
# One line per job: label, json name, driver arguments.
: >"$work/jobs"
for m in "${mutants[@]}"; do
  [ -x "$drivers/mutant_driver.$m" ] || { echo "no $drivers/mutant_driver.$m" >&2; exit 2; }
  for i in "${!sets[@]}"; do echo "$m $m.$i ${sets[$i]}" >>"$work/jobs"; done
done
if [ "$clean_calls" -gt 0 ]; then
  # 8 seeds; per class (2 traffic models x 2 page sizes x 3 T = 12 per prefix) the calls that
  # give 85% of N at prefix 512, 12% at 4K, 2.5% at 16K and 0.5% at 64K.
  for s in 1 2 3 4 5 6 7 8; do
    for share in "${shares[@]}"; do
      read -r prefix permille <<<"$share"
      c=$(( (clean_calls * permille / 10000 + 95) / 96 ))
      echo "clean clean.v$prefix.$s --prefixes $prefix --pages 1,64 --drafts 4,16,64 --calls $c" \
        "--budget 1e15 --drift --seed $((s * 7919 + prefix))" >>"$work/jobs"
    done
  done
fi

start=$(date +%s)
# shellcheck disable=SC2317  # run by xargs through bash -c
run_job() {
  local label=$1 name=$2 t0=$SECONDS
  shift 2
  if "$drivers/mutant_driver.$label" --engine "$engine" --label "$label" --commit "$commit" \
      --json "$work/json/$name.json" "$@" "${extra[@]}" >"$work/log/$name.log" 2>&1; then
    # The breaches, and the probe, determinism and invariance verdicts where the set ran them:
    # a run cut short before its report keeps them in its output.
    local verdicts
    verdicts=$(sed -n 's/^.* \(\(probe\|determinism\|invariance\): .*\)$/; \1/p' \
      "$work/log/$name.log" | tr -d '\n')
    echo "$name ($((SECONDS - t0)) s): $(tail -n 1 "$work/log/$name.log")$verdicts"
  else
    echo "$name: FAILED (exit $?): $(tail -n 3 "$work/log/$name.log" | tr '\n' ' ')"
    return 1
  fi
}
export -f run_job
export drivers engine commit work
extra_s=${extra[*]:-}
export extra_s
failed=0
# xargs runs --jobs at a time; a failed driver is reported and fails the run at the end.
xargs -P "$jobs" -L 1 bash -c 'extra=($extra_s); run_job "$@"' _ <"$work/jobs" || failed=1
echo "drivers ran in $(( $(date +%s) - start )) s"
mkdir -p "$out"
# The drivers' own JSON and logs, kept: the matrix can be rebuilt from them anywhere.
tar czf "$out/mutation-drivers.tgz" -C "$work" json log
check=(--check "$here/expected_cuda_survivors.txt")
python3 "$here/detection_matrix.py" --mode full --out "$out" --patches "$here/cuda_patches" \
  --name "$(date -u +%F)-$commit-cuda-mutation" "${check[@]}" "$work"/json/*.json || failed=1
exit $failed
