#pragma once
// Copies the pages a bundle names out of a paged pool into a compact one: the snapshot of a
// client's pool that work after the response reads, and the pages a capture writes out.

#include <cuda_runtime.h>

#include <cstdint>

namespace verifyd::kernels {

// dst page i = src page src_pages[i], for i in [0, n_pages); a page is page_bytes bytes, a
// multiple of 16. src_pages is device memory, checked against the pool by the caller.
cudaError_t LaunchGatherPages(const void* src, const int32_t* src_pages, int64_t n_pages,
                              int64_t page_bytes, void* dst, cudaStream_t stream);

}  // namespace verifyd::kernels
