#!/usr/bin/env bash
# Builds the libFuzzer targets with clang under ASan/UBSan into their own build directory and runs
# each one for a bounded time, starting from the seed corpus and the kept crashing inputs.
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   which targets (default: request safetensors state audit channel doorbell)
#   FUZZ_BUILD_DIR build directory (default: build-fuzz next to the sources)
# Fails when a target crashes, leaks, hits UB or a timeout; the input that did it is written to
# $FUZZ_BUILD_DIR/fuzz-artifacts/<target>/. Once fixed, keep it as a regression case in
# tests/fuzz/regressions/<target>/ (test_fuzz_corpus replays those in every build).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-request safetensors state audit channel doorbell}
clang=${FUZZ_CXX:-clang++-14}
command -v "$clang" >/dev/null || { echo "run_fuzz.sh: $clang not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }

CC=${clang/++/} CXX=$clang BUILD_DIR=$build \
  CMAKE_ARGS="-DVERIFYD_FUZZ=ON -DVERIFYD_SANITIZE=ON -DVERIFYD_ENABLE_CUDA=OFF ${CMAKE_ARGS:-}" \
  "$root/scripts/build.sh" --target $(for t in $targets; do printf 'fuzz_%s ' "$t"; done)

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
status=0
for t in $targets; do
  work=$build/fuzz-work/$t
  artifacts=$build/fuzz-artifacts/$t
  mkdir -p "$work" "$artifacts"
  dirs=("$work" "$root/tests/fuzz/corpus/$t")
  [ -d "$root/tests/fuzz/regressions/$t" ] && dirs+=("$root/tests/fuzz/regressions/$t")
  log=$build/fuzz-$t.log
  echo "== fuzz_$t for ${seconds} s"
  if "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$artifacts/" "${dirs[@]}" >"$log" 2>&1; then
    # The last status line carries coverage (cov), features (ft) and the corpus size.
    grep -E '^#[0-9]+' "$log" | tail -1
    grep -E 'stat::number_of_executed_units|stat::peak_rss_mb' "$log"
  else
    status=1
    echo "fuzz_$t FAILED; the input is in $artifacts/" >&2
    tail -60 "$log" >&2
  fi
done
exit $status
