#pragma once
// Copies the pages a bundle names out of a paged pool into a compact one: the snapshot of a
// client's pool that work after the response reads, and the pages a capture writes out.

#include <cuda_runtime.h>

#include <cstdint>

namespace verifyd::kernels {

// A contiguous range copied by the same launch as the pages (a deferred call's q).
struct CopyRange {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;  // 0: none; else a multiple of 16, src and dst 16-byte aligned
};

// dst page i = src page src_pages[i], for i in [0, n_pages); a page is page_bytes bytes, a
// multiple of 16. src_pages is device memory, checked against the pool by the caller. `also`
// is copied in the same launch. cudaErrorInvalidValue for sizes or addresses off 16 bytes.
cudaError_t LaunchGatherPages(const void* src, const int32_t* src_pages, int64_t n_pages,
                              int64_t page_bytes, void* dst, cudaStream_t stream,
                              CopyRange also = {});

// Whether `p` may be a CopyRange's src or dst.
inline bool CopyAligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace verifyd::kernels
