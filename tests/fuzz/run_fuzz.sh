#!/usr/bin/env bash
# Builds the libFuzzer targets with clang under ASan/UBSan into their own build directory and runs
# each one for a bounded time, starting from the seed corpus and the kept crashing inputs.
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   which targets (default: request safetensors state audit desired_state
#                  rollout_plan channel doorbell vmm_fds tap)
#   FUZZ_BUILD_DIR build directory (default: build-fuzz next to the sources)
#   FUZZ_JOBS      targets run at once (default: one per core)
# Fails when a target crashes, leaks, hits UB or a timeout; the input that did it is written to
# $FUZZ_BUILD_DIR/fuzz-artifacts/<target>/. Once fixed, keep it as a regression case in
# tests/fuzz/regressions/<target>/ (test_fuzz_corpus replays those in every build).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-request safetensors state audit desired_state rollout_plan channel doorbell vmm_fds tap}
clang=${FUZZ_CXX:-clang++-14}
command -v "$clang" >/dev/null || { echo "run_fuzz.sh: $clang not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }

CC=${clang/++/} CXX=$clang BUILD_DIR=$build \
  CMAKE_ARGS="-DVERIFYD_FUZZ=ON -DVERIFYD_SANITIZE=ON -DVERIFYD_ENABLE_CUDA=OFF ${CMAKE_ARGS:-}" \
  "$root/scripts/build.sh" --target $(for t in $targets; do printf 'fuzz_%s ' "$t"; done)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# Targets run FUZZ_JOBS at a time (default: one per core); each reports when it ends.
jobs_max=${FUZZ_JOBS:-$(nproc)}
run_one() {
  local t=$1 work=$build/fuzz-work/$1 artifacts=$build/fuzz-artifacts/$1 log=$build/fuzz-$1.log
  mkdir -p "$work" "$artifacts"
  local dirs=("$work" "$root/tests/fuzz/corpus/$t")
  [ -d "$root/tests/fuzz/regressions/$t" ] && dirs+=("$root/tests/fuzz/regressions/$t")
  if "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$artifacts/" "${dirs[@]}" >"$log" 2>&1; then
    # The last status line carries coverage (cov), features (ft) and the corpus size.
    { echo "== fuzz_$t for ${seconds} s"
      grep -E '^#[0-9]+' "$log" | tail -1
      grep -E 'stat::number_of_executed_units|stat::peak_rss_mb' "$log"; }
  else
    { echo "fuzz_$t FAILED; the input is in $artifacts/"; tail -60 "$log"; } >&2
    return 1
  fi
}
status=0
running=0
for t in $targets; do
  if [ "$running" -ge "$jobs_max" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
  run_one "$t" &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done
exit $status
