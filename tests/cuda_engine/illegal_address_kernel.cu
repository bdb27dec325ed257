#include "tests/cuda_engine/illegal_address_kernel.h"

#include <cstdint>

namespace verifyd::testing_kernels {
namespace {

__global__ void IllegalWriteKernel(int* p) { p[threadIdx.x] = 1; }

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t LoseContext(cudaStream_t stream) {
  // Bits above the 57-bit virtual address space: no mapping can cover it.
  IllegalWriteKernel<<<1, 1, 0, stream>>>(reinterpret_cast<int*>(uintptr_t{0xdead} << 48));
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaStreamSynchronize(stream);
}

}  // namespace verifyd::testing_kernels
