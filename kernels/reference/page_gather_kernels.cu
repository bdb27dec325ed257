#include "kernels/reference/page_gather_kernels.h"

namespace verifyd::kernels {
namespace {

// One block per unit (grid-strided), 16 bytes per thread per step. Units [0, n_pages) are the
// destination pages; the ones after them are page-sized chunks of the extra range.
__global__ void GatherPagesKernel(const uint4* __restrict__ src, const int32_t* __restrict__ pages,
                                  int64_t n_pages, int64_t page_vecs, uint4* __restrict__ dst,
                                  const uint4* __restrict__ also_src, int64_t also_vecs,
                                  uint4* __restrict__ also_dst) {
  const int64_t units = n_pages + (also_vecs + page_vecs - 1) / page_vecs;
  for (int64_t i = blockIdx.x; i < units; i += gridDim.x) {
    const uint4* from;
    uint4* to;
    int64_t n = page_vecs;
    if (i < n_pages) {
      from = src + static_cast<int64_t>(pages[i]) * page_vecs;
      to = dst + i * page_vecs;
    } else {
      const int64_t at = (i - n_pages) * page_vecs;
      from = also_src + at;
      to = also_dst + at;
      n = also_vecs - at < page_vecs ? also_vecs - at : page_vecs;
    }
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) to[v] = from[v];
  }
}

}  // namespace

cudaError_t LaunchGatherPages(const void* src, const int32_t* src_pages, int64_t n_pages,
                              int64_t page_bytes, void* dst, cudaStream_t stream, CopyRange also) {
  if (page_bytes <= 0 || page_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (also.bytes < 0 || also.bytes % 16 != 0 ||
      (also.bytes > 0 && (!CopyAligned(also.src) || !CopyAligned(also.dst)))) {
    return cudaErrorInvalidValue;
  }
  if (n_pages < 0) n_pages = 0;
  const int64_t page_vecs = page_bytes / 16;
  const int64_t units = n_pages + (also.bytes / 16 + page_vecs - 1) / page_vecs;
  if (units == 0) return cudaSuccess;
  const int threads = page_vecs >= 256 ? 256 : static_cast<int>((page_vecs + 31) / 32 * 32);
  const int64_t blocks = units < 65535 ? units : 65535;
  GatherPagesKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const uint4*>(src), src_pages, n_pages, page_vecs, static_cast<uint4*>(dst),
      static_cast<const uint4*>(also.src), also.bytes / 16, static_cast<uint4*>(also.dst));
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
