#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA sources too when nvcc is there) and runs every
# test. GPU suites skip with a message when no GPU is visible. SANITIZE=1 adds an ASan/UBSan build
# of the CPU targets and runs the CPU and service suites under it. FUZZ=1 runs every fuzz target
# for FUZZ_SECONDS (60) under ASan/UBSan; SOAK=1 runs the soak for SOAK_SECONDS (60).
# CONTAINER_STEPS=1 runs the container recipe's build steps on the host (a Release build of the
# daemon and the CLI, installed into a staging dir, then checked against the runtime stage).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
build=${BUILD_DIR:-$root/build}
BUILD_DIR=$build "$root/scripts/build.sh"
(cd "$build" && ctest --output-on-failure -j"$(nproc)" --timeout 600)
if [ "${SANITIZE:-0}" = 1 ]; then
  asan=$build-asan
  BUILD_DIR=$asan CMAKE_ARGS="-DVERIFYD_SANITIZE=ON -DVERIFYD_ENABLE_CUDA=OFF" \
    "$root/scripts/build.sh"
  (cd "$asan" && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j"$(nproc)" --timeout 900)
fi
if [ "${FUZZ:-0}" = 1 ]; then
  FUZZ_BUILD_DIR=$build-fuzz FUZZ_SECONDS=${FUZZ_SECONDS:-60} "$root/tests/fuzz/run_fuzz.sh"
fi
if [ "${SOAK:-0}" = 1 ]; then
  SOAK_SECONDS=${SOAK_SECONDS:-60} "$root/scripts/soak.sh" "$build"
fi
if [ "${CONTAINER_STEPS:-0}" = 1 ]; then
  rc=0
  "$root/deploy/container/check_build_steps.sh" || rc=$?
  [ "$rc" = 0 ] || [ "$rc" = 77 ] || exit "$rc"  # 77: not a Debian 12 host, skipped
fi
