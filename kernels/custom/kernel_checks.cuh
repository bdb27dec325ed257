#pragma once
// The in-process op's checks inside the kernels (CustomCallChecks, custom_attention.h): what v5t
// and the split combine look at beside their work, and the last CTA's verdict. With
// `checks.words` null (the engines' launches) every helper here is a no-op.

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/call_checks.h"
#include "kernels/custom/kernel_params.h"

namespace verifyd::kernels::custom {

__device__ __forceinline__ bool ChecksOn(const KernelParams& p) {
  return p.checks.words != nullptr;
}

// The call is not this step's (its serve byte is 0): uniform over the grid.
__device__ __forceinline__ bool NotServing(const KernelParams& p) {
  return ChecksOn(p) && p.checks.serve != nullptr && *p.checks.serve == 0;
}

// Request b's layout (RequestLayoutBad), before anything is read through it.
__device__ __forceinline__ unsigned LayoutVerdict(const KernelParams& p, int b, int kv_len) {
  if (!ChecksOn(p)) return 0;
  const bool bad =
      RequestLayoutBad(b, p.kv_indptr[b], p.kv_indptr[b + 1], kv_len, p.checks.max_indices,
                       p.draft, p.checks.max_kv_len, int64_t{1} << p.page_shift);
  return bad ? kVerdictLayoutBad : 0u;
}

// A page id as the kernel reads it: one outside the pool is flagged and read as page 0.
__device__ __forceinline__ int32_t CheckedPage(const KernelParams& p, int32_t page,
                                               unsigned& bad) {
  if (PageIdBad(page, p.pool_pages)) {
    bad |= kVerdictIndexBad;
    return 0;
  }
  return page;
}

// The mask rows of the CTA's query rows [m0, m0 + m_valid) of request b (every thread of the
// CTA; the first split's CTAs cover every row): 0/1 bytes, or no bit set past T.
__device__ __forceinline__ unsigned MaskVerdict(const KernelParams& p, int b, int m0,
                                                int m_valid) {
  const int t_first = m0 / p.heads, t_last = (m0 + m_valid - 1) / p.heads;
  const uint8_t* rows = p.tree_mask + (int64_t{b} * p.draft + t_first) * p.mask_row_bytes;
  const int tokens = t_last - t_first + 1;
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  unsigned bad = 0;
  if (!p.mask_bits) {
    const int n = tokens * p.mask_row_bytes;
    for (int i = tid; i < n; i += threads) {
      if (MaskByteBad(rows[i], false, p.draft, false)) bad = kVerdictMaskBad;
    }
  } else if ((p.draft & 7) != 0) {  // only a row's last byte can hold a bit past T
    for (int t = tid; t < tokens; t += threads) {
      const int64_t last = int64_t{t} * p.mask_row_bytes + p.mask_row_bytes - 1;
      if (MaskByteBad(rows[last], true, p.draft, true)) bad = kVerdictMaskBad;
    }
  }
  return bad;
}

// Whether one of the two bf16 in `w` is a NaN or an Inf (all exponent bits set).
__device__ __forceinline__ bool NonFiniteBf16Pair(uint32_t w) {
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

// Called by every thread of the CTA with what it found. ORs the findings into the verdict; with
// `counts` (the grid that finishes the call: the fused kernel unsplit, else the combine), the
// last CTA to get here turns the verdict into the failed byte (and the fallback's handle) and
// clears both words for the next call.
__device__ __forceinline__ void FinishCta(const KernelParams& p, unsigned bad, bool counts) {
  if (!ChecksOn(p)) return;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  bad = __reduce_or_sync(0xffffffffu, bad);
  if (bad != 0 && (tid & 31) == 0) atomicOr(p.checks.words, bad);
  if (!counts) return;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd(p.checks.words + 1, 1u) == ctas - 1) {
      const unsigned v = atomicExch(p.checks.words, 0u);
      *p.checks.failed = v != 0 ? 1 : 0;
      if (p.checks.set_fallback) cudaGraphSetConditional(p.checks.fallback, v != 0 ? 1u : 0u);
      atomicExch(p.checks.words + 1, 0u);
    }
  }
}

}  // namespace verifyd::kernels::custom
