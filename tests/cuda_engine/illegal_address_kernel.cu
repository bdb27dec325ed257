#include "tests/cuda_engine/illegal_address_kernel.h"

namespace verifyd::testing_kernels {
namespace {

__global__ void IllegalWriteKernel(int* p) { p[threadIdx.x] = 1; }

}  // namespace

cudaError_t LaunchIllegalWrite(cudaStream_t stream) {
  // Far outside any allocation, and not null (a null store can be optimized differently).
  IllegalWriteKernel<<<1, 1, 0, stream>>>(reinterpret_cast<int*>(0x10000000000ull));
  return cudaGetLastError();
}

}  // namespace verifyd::testing_kernels
