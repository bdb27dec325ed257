#include "kernels/reference/page_gather_kernels.h"

namespace verifyd::kernels {
namespace {

// One block per destination page (grid-strided over pages), 16 bytes per thread per step.
__global__ void GatherPagesKernel(const uint4* __restrict__ src, const int32_t* __restrict__ pages,
                                  int64_t n_pages, int64_t page_vecs, uint4* __restrict__ dst) {
  for (int64_t i = blockIdx.x; i < n_pages; i += gridDim.x) {
    const uint4* from = src + static_cast<int64_t>(pages[i]) * page_vecs;
    uint4* to = dst + i * page_vecs;
    for (int64_t v = threadIdx.x; v < page_vecs; v += blockDim.x) to[v] = from[v];
  }
}

}  // namespace

cudaError_t LaunchGatherPages(const void* src, const int32_t* src_pages, int64_t n_pages,
                              int64_t page_bytes, void* dst, cudaStream_t stream) {
  if (n_pages <= 0) return cudaSuccess;
  if (page_bytes <= 0 || page_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int64_t page_vecs = page_bytes / 16;
  const int threads = page_vecs >= 256 ? 256 : static_cast<int>((page_vecs + 31) / 32 * 32);
  const int64_t blocks = n_pages < 65535 ? n_pages : 65535;
  GatherPagesKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const uint4*>(src), src_pages, n_pages, page_vecs, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
