#pragma once
// An e4m3 KV pool on the device, for kernels that read bf16 (kernels/e4m3.h, README.md "FP8 KV
// caches"): the pages a bundle names become a compact bf16 pool of the e4m3 values themselves
// (exact), and the scale goes onto the logits (sm_scale x kv_scale) and onto each served path's
// output before its rounding (VerifyProblem::o_scale). The oracle reads the e4m3 pool itself.

#include <cuda_runtime.h>

#include <cstdint>

namespace verifyd::kernels {

// dst page i = the bf16 values of src page src_pages[i], for i in [0, n_pages), and
// dst_pages[i] = i. A page is page_elems elements (a multiple of 16). A page id outside
// [0, src_num_pages) gives a page of NaN and reads nothing. All pointers are device memory.
cudaError_t LaunchDequantizeE4m3Pages(const uint8_t* src, const int32_t* src_pages, int64_t n_pages,
                                      int64_t src_num_pages, int64_t page_elems, uint16_t* dst,
                                      int32_t* dst_pages, cudaStream_t stream);

}  // namespace verifyd::kernels
