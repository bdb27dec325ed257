#pragma once
// Arguments of the fused kernel and the split combine, passed by value as one struct.

#include <cstdint>

#include "kernels/custom/custom_attention.h"  // CustomCallChecks

namespace verifyd::kernels::custom {

struct KernelParams {
  const uint16_t* q;          // bf16 [B*T*H, 576]
  const uint16_t* kv_pool;    // bf16 [num_pages * page_size, 576]; e4m3 bytes for kE4m3 kernels
  const int32_t* kv_indptr;   // [B+1]
  const int32_t* kv_indices;  // page ids
  const int32_t* kv_lens;     // [B]
  const uint8_t* tree_mask;   // [B, T, mask_row_bytes]
  int draft;                  // T
  int heads;                  // H
  int rows;                   // T*H query rows per request
  int page_shift;             // log2(page_size)
  int mask_bits;              // 1: bit-packed mask rows, 0: one byte per key
  int mask_row_bytes;
  float scale_log2;  // sm_scale * log2(e), times kv_scale for an e4m3 pool
  int splits;
  int tiles_per_split;
  uint16_t* o;              // bf16 [B*T*H, 512]
  float* lse;               // fp32 [B*T*H] or null
  float* o_partial;         // fp32 [splits, B*T*H, 512] when splits > 1
  float* lse_partial;       // fp32 [splits, B*T*H]
  int64_t rows_total;       // B*T*H
  const unsigned* skip;     // device word or null: nonzero when the kernels run = write nothing
  float o_scale;            // o's factor before its rounding: an e4m3 pool's kv_scale, else 1
  uint32_t page_limit;      // PageIdLimit of the pool: a page id past it is read as page 0 (v5)
  CustomCallChecks checks;  // the op's checks inside the kernel (kernel_checks.cuh)
};

// Whether a launch is to write nothing: its inputs failed a device check made before it.
__device__ __forceinline__ bool SkipLaunch(const KernelParams& p) {
  return p.skip != nullptr && *p.skip != 0;
}

}  // namespace verifyd::kernels::custom
