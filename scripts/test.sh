#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA sources too when nvcc is there) and runs the
# tests. GPU suites skip with a message when no GPU is visible. Prints each stage's time at the end.
#
# The quick lane (the default, and what CI runs):
#   - the main build (no debug information, DEBUG_INFO=OFF; CUDA for sm_90a only, CUDA_ARCHS
#     overrides it) and every suite in it but those labelled sanitize, which run in the sanitizer
#     build instead (with SANITIZE=0 they run here), the CPU mutation suite's quick lane
#     included; each GPU suite is one CTest test that skips without a GPU; both builds merge each
#     target's sources into a few units (CMake's unity build, UNITY=ON), which parses the gRPC and
#     protobuf headers once per unit instead of once per file;
#   - clang-format over the tree (scripts/check_format.sh), beside the tests;
#   - one clang build with ASan/UBSan (build-san) of the parsers', the transport's and the
#     service's suites and the shipped binaries (CMake target sanitize_suite, CTest label
#     sanitize), and of the libFuzzer targets;
#   - each fuzz target for FUZZ_SECONDS (15) on its seed corpus and kept inputs, one per core at a
#     time, with the soak (SOAK_SECONDS, 30) running beside them.
#
# FULL=1 adds the full lanes; run them before a change that touches their area:
#   - CUDA for every shipped architecture (90a and 120), with debug information, each source
#     file compiled alone (UNITY=OFF: every file must include what it uses);
#   - every CPU suite under ASan/UBSan, mutation included;
#   - fuzz targets for 60 s each and a 60 s soak;
#   - both container recipes' build steps on the host (deploy/container/check_build_steps.sh;
#     the CUDA one needs nvcc 13.0, about half an hour on 2 cores).
# Each piece can be switched on or off alone: SANITIZE, FUZZ, SOAK, CONTAINER_STEPS, FORMAT (1/0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
full=${FULL:-0}
if [ "$full" = 1 ]; then
  : "${FUZZ_SECONDS:=60}" "${SOAK_SECONDS:=60}" "${CONTAINER_STEPS:=1}" "${CUDA_ARCHS:=90a;120}"
  : "${DEBUG_INFO:=ON}" "${UNITY:=OFF}"
else
  : "${FUZZ_SECONDS:=15}" "${SOAK_SECONDS:=30}" "${CONTAINER_STEPS:=0}" "${CUDA_ARCHS:=90a}"
  : "${DEBUG_INFO:=OFF}" "${UNITY:=ON}"
fi
: "${SANITIZE:=1}" "${FUZZ:=1}" "${SOAK:=1}" "${FORMAT:=1}"

stages=()
stage() {  # stage NAME COMMAND...: runs it and records its time
  local name=$1 t0=$SECONDS
  shift
  echo "== stage: $name"
  "$@"
  stages+=("$(printf '%-16s %5d s' "$name" $((SECONDS - t0)))")
}
report() {
  local rc=$?
  echo "== stage times (total $SECONDS s)"
  for s in "${stages[@]}"; do echo "   $s"; done
  [ "$rc" = 0 ] || echo "== FAILED (exit $rc) in the stage after the last one listed"
}
trap report EXIT

stage deps "$root/scripts/install_deps.sh"
build=${BUILD_DIR:-$root/build}
stage build env BUILD_DIR="$build" \
  CMAKE_ARGS="-DVERIFYD_CUDA_ARCHS=$CUDA_ARCHS -DVERIFYD_DEBUG_INFO=$DEBUG_INFO \
    -DCMAKE_UNITY_BUILD=$UNITY ${CMAKE_ARGS:-}" \
  "$root/scripts/build.sh"
# The quick lane runs each suite once: the suites labelled sanitize run in the sanitizer build
# (below), the rest here. clang-format checks the tree beside them.
main_labels=()
[ "$full" = 0 ] && [ "$SANITIZE" = 1 ] && main_labels=(-LE sanitize)
main_tests() { cd "$build" && ctest --output-on-failure -j"$(nproc)" --timeout 900 "${main_labels[@]}"; }
tests_and_format() {
  local log=$build/format.log rc=0 format_pid
  "$root/scripts/check_format.sh" >"$log" 2>&1 &
  format_pid=$!
  (main_tests) || rc=$?
  wait "$format_pid" || { echo "format FAILED"; rc=1; }
  cat "$log"
  return $rc
}
if [ "$FORMAT" = 1 ]; then
  stage tests+format tests_and_format
else
  stage tests main_tests
fi
# One clang build for the sanitizer suites and the fuzz targets: ASan/UBSan everywhere, libFuzzer's
# coverage on the parsers only (tests/fuzz/CMakeLists.txt).
san=$build-san
if [ "$SANITIZE" = 1 ] || [ "$FUZZ" = 1 ]; then
  san_targets=(--target sanitize_suite)  # the quick lane: parsers, transport, service, fuzzers
  [ "$full" = 1 ] && san_targets=()      # FULL: every CPU target
  stage san-build env CC=clang-14 CXX=clang++-14 BUILD_DIR="$san" \
    CMAKE_ARGS="-DVERIFYD_SANITIZE=ON -DVERIFYD_FUZZ=ON -DVERIFYD_ENABLE_CUDA=OFF \
    -DCMAKE_UNITY_BUILD=$UNITY" \
    "$root/scripts/build.sh" "${san_targets[@]}"
fi
if [ "$SANITIZE" = 1 ]; then
  labels=(-L sanitize)
  [ "$full" = 1 ] && labels=()
  stage san-tests bash -c "cd '$san' && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure \
    -j$(nproc) --timeout 900 ${labels[*]}"
fi
fuzz() { env FUZZ_BUILD_DIR="$san" FUZZ_SECONDS="$FUZZ_SECONDS" "$root/tests/fuzz/run_fuzz.sh"; }
soak() { env SOAK_SECONDS="$SOAK_SECONDS" "$root/scripts/soak.sh" "$build"; }
# The soak runs beside the fuzz targets (one per core): both are bounded by time, not by work.
fuzz_and_soak() {
  local log=$build/soak.log rc=0 soak_pid
  soak > "$log" 2>&1 &
  soak_pid=$!
  fuzz || rc=$?
  wait "$soak_pid" || { echo "soak FAILED"; rc=1; }
  cat "$log"
  return $rc
}
if [ "$FUZZ" = 1 ] && [ "$SOAK" = 1 ]; then
  stage fuzz+soak fuzz_and_soak
elif [ "$FUZZ" = 1 ]; then
  stage fuzz fuzz
elif [ "$SOAK" = 1 ]; then
  stage soak soak
fi
if [ "$CONTAINER_STEPS" = 1 ]; then
  container_steps() {
    local rc
    for recipe in Dockerfile Dockerfile.cuda; do
      rc=0
      "$root/deploy/container/check_build_steps.sh" --dockerfile "$root/deploy/container/$recipe" \
        || rc=$?
      [ "$rc" = 0 ] || [ "$rc" = 77 ] || return "$rc"  # 77: this host cannot rehearse it
    done
  }
  stage container container_steps
fi
