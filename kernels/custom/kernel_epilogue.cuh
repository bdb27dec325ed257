#pragma once
// The fused kernels' last step: one output row normalized by its softmax sum and stored, as bf16
// o and f32 lse when the KV is not split, else as f32 partials for the split combine.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/custom/device_primitives.cuh"
#include "kernels/custom/kernel_checks.cuh"
#include "kernels/custom/kernel_params.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels::custom {

// Row r (of the CTA's kRows, global row row0 + r): its outputs held by this thread are dims
// dim0 + 8 * nt + 2 * tq (+1) for nt < num_nt, from o_acc[first_acc + nt * nt_stride + 2 * half]
// (+1). red[r] + red[kRows + r] is the row's softmax sum, row_scale[r] its running max (log2).
// Returns whether what it stored of o and lse is not finite (kernel_checks.cuh); false for
// partials, which the combine checks.
template <int kRows>
__device__ __forceinline__ bool StoreOutputRow(const KernelParams& p, const float (&o_acc)[128],
                                               const float* red, const float* row_scale,
                                               int64_t row0, int split, int tq, int r, int dim0,
                                               int first_acc, int nt_stride, int num_nt, int half) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float l = red[r] + red[kRows + r];
  // l == 0: the row saw no key in this range; zeros and lse = -inf, never 0 * inf.
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const float lse = l > 0.f ? row_scale[r] * kLn2 + logf(l) : -INFINITY;
  const int64_t grow = row0 + r;
  const bool write_lse = dim0 == 0 && tq == 0;
  if (p.splits == 1) {
    uint32_t* orow = reinterpret_cast<uint32_t*>(p.o + grow * kHeadDimV + dim0 + 2 * tq);
    const float scaled = inv * p.o_scale;  // exactly inv for a bf16 pool
    bool non_finite = write_lse && !isfinite(lse);
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) {
      if (nt < num_nt) {
        const int a = first_acc + nt * nt_stride + 2 * half;
        const uint32_t w = PackBf16x2(o_acc[a] * scaled, o_acc[a + 1] * scaled);
        non_finite |= NonFiniteBf16Pair(w);
        orow[nt * 4] = w;
      }
    }
    if (p.lse != nullptr && write_lse) p.lse[grow] = lse;
    return non_finite;
  } else {
    const int64_t prow = split * p.rows_total + grow;
    float2* orow = reinterpret_cast<float2*>(p.o_partial + prow * kHeadDimV + dim0 + 2 * tq);
#pragma unroll
    for (int nt = 0; nt < 32; ++nt) {
      if (nt < num_nt) {
        const int a = first_acc + nt * nt_stride + 2 * half;
        orow[nt * 4] = make_float2(o_acc[a] * inv, o_acc[a + 1] * inv);
      }
    }
    if (write_lse) p.lse_partial[prow] = lse;
    return false;
  }
}

}  // namespace verifyd::kernels::custom
