#include "kernels/reference/kv_dequantize_kernels.h"

#include <cuda_bf16.h>

#include "kernels/e4m3.h"

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// One thread per 16 e4m3 bytes of a page (one 16-byte load, two 16-byte stores).
__global__ void DequantizeE4m3PagesKernel(const uint8_t* src, const int32_t* src_pages,
                                          int64_t n_pages, int64_t src_num_pages,
                                          int64_t page_elems, uint16_t* dst, int32_t* dst_pages) {
  const int64_t chunks = page_elems / 16;
  const int64_t total = n_pages * chunks;
  for (int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x; c < total;
       c += int64_t{gridDim.x} * kThreads) {
    const int64_t i = c / chunks, k = c % chunks;
    const int32_t page = src_pages[i];
    alignas(16) uint16_t out[16];  // stored as two 16-byte vectors
    if (page < 0 || page >= src_num_pages) {
      for (int e = 0; e < 16; ++e) out[e] = 0x7fc0;  // bf16 quiet NaN
    } else {
      const uint4 in = reinterpret_cast<const uint4*>(src + page * page_elems)[k];
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&in);
      for (int e = 0; e < 16; ++e) {
        out[e] = __bfloat16_as_ushort(__float2bfloat16_rn(E4m3ToFloat(b[e])));
      }
    }
    uint4* to = reinterpret_cast<uint4*>(dst + i * page_elems + k * 16);
    to[0] = reinterpret_cast<const uint4*>(out)[0];
    to[1] = reinterpret_cast<const uint4*>(out)[1];
    if (k == 0) dst_pages[i] = static_cast<int32_t>(i);
  }
}

unsigned Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

}  // namespace

cudaError_t LaunchDequantizeE4m3Pages(const uint8_t* src, const int32_t* src_pages, int64_t n_pages,
                                      int64_t src_num_pages, int64_t page_elems, uint16_t* dst,
                                      int32_t* dst_pages, cudaStream_t stream) {
  if (n_pages < 0 || page_elems <= 0 || page_elems % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  if (n_pages == 0) return cudaSuccess;
  DequantizeE4m3PagesKernel<<<Blocks(n_pages * (page_elems / 16)), kThreads, 0, stream>>>(
      src, src_pages, n_pages, src_num_pages, page_elems, dst, dst_pages);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
