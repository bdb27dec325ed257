#include "bench/ceilings.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bench/bench_timing.h"

namespace verifyd::bench {
namespace {

// Uniform bf16 values in [-1, 1) from a hash of the index: random data, never zeros.
__global__ void FillRandomBf16(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    x[i] = __float2bfloat16(static_cast<float>(h & 0xffffu) / 32768.f - 1.f);
  }
}

}  // namespace

Ceilings MeasureCeilings(cublasHandle_t handle, int mnk, int64_t copy_bytes, int reps) {
  Ceilings c;
  c.gemm_mnk = mnk;
  c.copy_bytes = copy_bytes;
  const int64_t elems = int64_t{mnk} * mnk;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *d = nullptr;
  void *src = nullptr, *dst = nullptr;
  cudaStream_t stream = nullptr;
  auto fail = [&](const char* what) {
    c.error = what;
    return c;
  };
  if (cudaStreamCreate(&stream) != cudaSuccess) return fail("stream");
  if (cudaMalloc(&a, elems * 2) != cudaSuccess || cudaMalloc(&b, elems * 2) != cudaSuccess ||
      cudaMalloc(&d, elems * 2) != cudaSuccess) {
    return fail("gemm allocation");
  }
  FillRandomBf16<<<1024, 256, 0, stream>>>(a, elems, 1);
  FillRandomBf16<<<1024, 256, 0, stream>>>(b, elems, 2);
  cublasSetStream(handle, stream);
  const float alpha = 1.f, beta = 0.f;
  auto gemm = [&] {
    return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, mnk, mnk, mnk, &alpha, a, CUDA_R_16BF,
                        mnk, b, CUDA_R_16BF, mnk, &beta, d, CUDA_R_16BF, mnk, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
               ? cudaSuccess
               : cudaErrorUnknown;
  };
  const double gemm_ms = MedianMs(stream, 3, reps, [&](int) { return gemm(); });
  if (gemm_ms <= 0) return fail("gemm");
  c.gemm_tflops = 2.0 * mnk * double(mnk) * mnk / (gemm_ms * 1e-3) / 1e12;
  cudaFree(a);
  cudaFree(b);
  cudaFree(d);

  if (cudaMalloc(&src, copy_bytes) != cudaSuccess || cudaMalloc(&dst, copy_bytes) != cudaSuccess) {
    return fail("copy allocation");
  }
  FillRandomBf16<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(src), copy_bytes / 2, 3);
  const double copy_ms = MedianMs(stream, 3, reps, [&](int) {
    return cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream);
  });
  if (copy_ms <= 0) return fail("copy");
  c.copy_gbps = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
  return c;
}

}  // namespace verifyd::bench
