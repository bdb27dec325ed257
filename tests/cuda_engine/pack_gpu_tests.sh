#!/usr/bin/env bash
# Packs the GPU suites of the reference kernels and the CUDA engine, with the non-system shared
# libraries they need, into .gpu/cuda/ (git-ignored) for the GPU machine, which has the CUDA
# toolkit but not the project's other libraries. Usage: pack_gpu_tests.sh [build dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-cuda}
out=$root/.gpu/cuda
bins=(test_reference_kernels test_cuda_engine test_cuda_sticky_error)

cmake --build "$build" -j2 --target "${bins[@]}"
rm -rf "$out"
mkdir -p "$out/lib"
for b in "${bins[@]}"; do
  strip --strip-debug -o "$out/$b" "$build/tests/cuda_engine/$b"
done
# Everything ldd resolves except the C runtime, libstdc++/libgcc (newer on the GPU machine) and
# CUDA itself (the machine's own, /usr/local/cuda/lib64, matching its driver).
for b in "${bins[@]}"; do ldd "$build/tests/cuda_engine/$b"; done |
  awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
cp "$root/tests/cuda_engine/run_gpu_tests.sh" "$out/"
du -sh "$out"
