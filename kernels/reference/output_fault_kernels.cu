#include "kernels/reference/output_fault_kernels.h"

#include <cuda_bf16.h>

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

__global__ void AddToBf16Kernel(uint16_t* o, int64_t n, float amount) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    const float v = __uint_as_float(static_cast<uint32_t>(o[i]) << 16) + amount;
    o[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

__global__ void FillNanBf16Kernel(uint16_t* o, int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kThreads) {
    o[i] = 0x7fc0;  // bf16 quiet NaN
  }
}

unsigned Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

}  // namespace

cudaError_t LaunchAddToBf16(uint16_t* o, int64_t n, float amount, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(o, n, amount);
  return cudaGetLastError();
}

cudaError_t LaunchFillNanBf16(uint16_t* o, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FillNanBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(o, n);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
