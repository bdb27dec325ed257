#pragma once
// The in-process op's checks inside the kernels (CustomCallChecks, custom_attention.h): what v5t
// and the split combine look at beside their work, and the last CTA's verdict. With
// `checks.words` null (the engines' launches) every helper here is a no-op.

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/call_checks.h"
#include "kernels/custom/kernel_params.h"

namespace verifyd::kernels::custom {

#if defined(VERIFYD_KERNEL_TRACE)
// The trace build (bench/kernel_trace.cu) stamps the schedule's phases, which the checks are not
// part of: compiled out, they leave the kernel's registers as the trace has always seen them.
__device__ __forceinline__ bool ChecksOn(const KernelParams&) { return false; }
#else
__device__ __forceinline__ bool ChecksOn(const KernelParams& p) {
  return p.checks.words != nullptr;
}
#endif

// The call is not this step's (its serve byte is 0): uniform over the grid.
__device__ __forceinline__ bool NotServing(const KernelParams& p) {
  return ChecksOn(p) && p.checks.serve != nullptr && *p.checks.serve == 0;
}

// Request b's layout (RequestLayoutBad), before anything is read through it.
__device__ __forceinline__ unsigned LayoutVerdict(const KernelParams& p, int b, int kv_len) {
  if (!ChecksOn(p)) return 0;
  const bool bad =
      RequestLayoutBad(b, p.kv_indptr[b], p.kv_indptr[b + 1], kv_len, p.checks.max_indices, p.draft,
                       p.checks.max_kv_len, int64_t{1} << p.page_shift);
  return bad ? kVerdictLayoutBad : 0u;
}

// A finding of a check made during the kernel's work, ORed into the verdict at once (findings
// are rare, and no register then holds one through the kernel's loop).
__device__ __forceinline__ void Report(const KernelParams& p, unsigned bits) {
  if (ChecksOn(p)) atomicOr(p.checks.words, bits);
}

// A page id as the kernel reads it: one outside the pool is reported and read as page 0.
__device__ __forceinline__ int32_t CheckedPage(const KernelParams& p, int32_t page) {
  if (PageIdBad(page, p.page_limit)) {
    Report(p, kVerdictIndexBad);
    return 0;
  }
  return page;
}

// The mask rows of the CTA's query rows [m0, m0 + m_valid) of request b (every thread of the
// CTA; the first split's CTAs cover every row): 0/1 bytes, or no bit set past T. Reported.
__device__ __forceinline__ void CheckMaskRows(const KernelParams& p, int b, int m0, int m_valid) {
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
  if (bad != 0) Report(p, bad);
}

// The CTA's count towards the call's end, by its first thread once every finding of the CTA is
// in the verdict: with `counts` (the grid that finishes the call: the fused kernel unsplit, else
// the combine), the last CTA to count turns the verdict into the failed byte and clears both words
// for the next call. No device-runtime call here (cudaGraphSetConditional): in v5t it would
// serialise wgmma.
__device__ __forceinline__ void CountCta(const KernelParams& p, bool counts) {
  if (!counts || threadIdx.x != 0 || threadIdx.y != 0) return;
  __threadfence();
  const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
  if (atomicAdd(p.checks.words + 1, 1u) == ctas - 1) {
    const unsigned v = atomicExch(p.checks.words, 0u);
    *p.checks.failed = v != 0 ? 1 : 0;
    atomicExch(p.checks.words + 1, 0u);
  }
}

// A CTA that returns early, for a reason `bits` the same in every thread (0: none): its first
// thread reports it and counts. Nothing else of the CTA was reported.
__device__ __forceinline__ void FinishCtaEarly(const KernelParams& p, unsigned bits, bool counts) {
  if (!ChecksOn(p)) return;
  if (bits != 0 && threadIdx.x == 0 && threadIdx.y == 0) Report(p, bits);
  CountCta(p, counts);
}

// A CTA at its end, every thread of it, after each reported what it found (Report): the count
// waits for all of them.
__device__ __forceinline__ void FinishCta(const KernelParams& p, bool counts) {
  if (!ChecksOn(p) || !counts) return;
  __syncthreads();
  CountCta(p, counts);
}

}  // namespace verifyd::kernels::custom
