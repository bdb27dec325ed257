#!/usr/bin/env bash
# Packs what the GPU machine runs into one folder: the GPU test and benchmark binaries of a
# build, verifyd and verifyctl with the service suites, the non-system shared libraries they
# load, the golden cases, gpu_run.sh, gpu_service_bench.sh and the commit.
# The GPU machine has the CUDA toolkit (libcudart, libcublas in /usr/local/cuda/lib64) and a
# newer C/C++ runtime, not the project's other libraries.
#
#   scripts/gpu_pack.sh [BUILD_DIR] [PACK_DIR]      (defaults: build-cuda, .gpu/pack)
#   extra binaries (paths relative to BUILD_DIR): VERIFYD_PACK_BINS="tests/x/test_y ..."
#   only these binaries instead of the list below (a kernel-only pack): VERIFYD_PACK_ONLY="..."
#   the CUDA mutation suite's drivers: VERIFYD_PACK_MUTANTS=DIR (build_cuda_mutants.sh's output)
#   FlashMLA, the peer of gpu_inprocess_bench.sh: VERIFYD_PACK_FLASHMLA=DIR (bench/flashmla_peer)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "${1:-$ROOT/build-cuda}" && pwd)
PACK=${2:-$ROOT/.gpu/pack}

BINS=(tests/kernels/test_custom_kernel tests/kernels/test_custom_kernel_golden
      tests/kernels/test_custom_kernel_checks
      tests/kernels/test_custom_plan bench/verifyd-bench bench/verifyd-engine-bench
      bench/verifyd-kernel-trace
      tests/cuda_engine/test_reference_kernels tests/cuda_engine/test_cuda_engine
      tests/cuda_engine/test_cuda_sticky_error
      tests/service/test_service
      src/main/verifyd src/cli/verifyctl src/cli/verifyd-replay)
# shellcheck disable=SC2206
[[ -n ${VERIFYD_PACK_ONLY:-} ]] && BINS=(${VERIFYD_PACK_ONLY})
# shellcheck disable=SC2206
BINS+=(${VERIFYD_PACK_BINS:-})

# Libraries the GPU machine provides itself: the C runtime (glibc, libstdc++, libgcc_s, which
# are newer there), the driver, and the CUDA toolkit's cuBLAS.
SYSTEM_LIBS='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.'
SYSTEM_LIBS+='|libstdc\+\+|libgcc_s|libcuda\.|libcublas)'

rm -rf "$PACK"
mkdir -p "$PACK/bin" "$PACK/lib" "$PACK/data"
for b in "${BINS[@]}"; do
  if [[ ! -x "$BUILD/$b" ]]; then
    echo "gpu_pack: missing $BUILD/$b (build it first: cmake --build $BUILD)" >&2
    exit 1
  fi
  cp "$BUILD/$b" "$PACK/bin/"
  strip --strip-debug "$PACK/bin/$(basename "$b")"  # host debug info only; device -lineinfo stays
  ldd "$BUILD/$b" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
    name=$(basename "$lib")
    if [[ ! "$name" =~ $SYSTEM_LIBS && ! -e "$PACK/lib/$name" ]]; then
      cp -L "$lib" "$PACK/lib/$name"
    fi
  done
done
cp -r "$ROOT/tests/data/golden" "$PACK/data/"
# The CUDA mutation suite, when its drivers were built (tests/mutation/build_cuda_mutants.sh):
# VERIFYD_PACK_MUTANTS=DIR. gpu_run.sh --mutants runs it.
if [[ -n ${VERIFYD_PACK_MUTANTS:-} ]]; then
  rm -rf "$PACK/mutants" "$PACK/mutation"
  cp -r "$VERIFYD_PACK_MUTANTS" "$PACK/mutants"
  for d in "$PACK"/mutants/mutant_driver.*; do  # their libraries, when no binary above brought them
    ldd "$d" | awk '/=>/ && $3 ~ /^\// {print $3}' | while read -r lib; do
      name=$(basename "$lib")
      [[ "$name" =~ $SYSTEM_LIBS || -e "$PACK/lib/$name" ]] || cp -L "$lib" "$PACK/lib/$name"
    done
  done
  mkdir -p "$PACK/mutation"
  cp -r "$ROOT"/tests/mutation/{run_cuda_mutants.sh,detection_matrix.py,expected_cuda_survivors.txt,cuda_patches} \
    "$PACK/mutation/"
fi
# The tap kernel's library, which the Python client loads (VERIFYD_TAP_LIB), when it was built,
# and its variant with the one-load copy, the baseline gpu_tap_bench.sh times it against.
for lib in libverifyd_tap.so libverifyd_tap_one_load.so; do
  if [[ -e "$BUILD/kernels/tap/$lib" ]]; then
    cp "$BUILD/kernels/tap/$lib" "$PACK/lib/"
  fi
done
# The custom kernel as the serving process loads it (VERIFYD_KERNEL_LIB), when it was built.
if [[ -e "$BUILD/kernels/op/libverifyd_kernel.so" ]]; then
  cp "$BUILD/kernels/op/libverifyd_kernel.so" "$PACK/lib/"
fi
cp "$ROOT/scripts/gpu_run.sh" "$ROOT/scripts/gpu_service_bench.sh" "$ROOT/scripts/gpu_region_test.sh" \
  "$ROOT/scripts/gpu_probe_cost.sh" "$ROOT/scripts/gpu_stack_bench.sh" "$ROOT/scripts/gpu_tap_bench.sh" \
  "$ROOT/scripts/gpu_stack_rounds.sh" "$ROOT/scripts/gpu_stack_env.sh" \
  "$ROOT/scripts/gpu_invariance_run.sh" "$ROOT/scripts/gpu_inprocess_bench.sh" \
  "$PACK/"

# The Python client, its GPU test (cuda_ipc with torch) and stubs generated here; the GPU machine
# regenerates them when it has grpc_tools.
mkdir -p "$PACK/py/clients/python" "$PACK/py/tests/python"
cp -r "$ROOT/clients/python/verifyd_client" "$ROOT/clients/python/generate.sh" "$PACK/py/clients/python/"
rm -rf "$PACK/py/clients/python/verifyd_client/_gen" "$PACK/py/clients/python/verifyd_client/__pycache__"
cp "$ROOT"/tests/python/{gpu_cuda_ipc_test.py,gpu_doorbell_test.py,gpu_vmm_test.py,gpu_region_set_test.py,gpu_tap_test.py,gpu_kernel_op_test.py,gpu_switch_verifyd_test.py,random_bundles.py,sglang_reference.py} \
  "$PACK/py/tests/python/"
mkdir -p "$PACK/py/bench"
cp "$ROOT/bench/stack_bench.py" "$ROOT/bench/tap_bench.py" "$ROOT/bench/inprocess_bench.py" "$ROOT/bench/inprocess_report.py" \
  "$ROOT/bench/cuda_timing.py" "$PACK/py/bench/"
cp -r "$ROOT/bench/flashmla_peer" "$PACK/py/bench/"
# FlashMLA as the peer, when bench/flashmla_peer/prepare.sh laid it out (VERIFYD_PACK_FLASHMLA=DIR:
# its sources, or a folder holding an already built flashmla_dense.so).
if [[ -n ${VERIFYD_PACK_FLASHMLA:-} ]]; then
  cp -r "$VERIFYD_PACK_FLASHMLA" "$PACK/flashmla"
  rm -rf "$PACK/flashmla/build"
fi
# The SGLang adapters' test; gpu_run.sh runs it on CUDA tensors and through verifyd.
cp "$ROOT"/tests/python/{test_adapters.py,verifyd_daemon.py} "$PACK/py/tests/python/"
cp -r "$ROOT/proto" "$PACK/py/"
"$ROOT/clients/python/generate.sh" "$PACK/py/gen" > /dev/null

commit=$("$ROOT/scripts/commit_stamp.sh" "$ROOT" kernels bench src tests proto)
echo "$commit" > "$PACK/COMMIT"
echo "gpu_pack: $PACK ($(du -sh "$PACK" | cut -f1)), commit $commit"
ls "$PACK/lib"
