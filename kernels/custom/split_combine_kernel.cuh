#pragma once
// Merges the split-KV partials of the fused kernel by log-sum-exp.
// grid ceil(B*T*H / 4), block (128, 4): one row per y, four output dims per thread.
//   o_partial [splits, B*T*H, 512] f32, lse_partial [splits, B*T*H] f32
//   -> o [B*T*H, 512] bf16, lse [B*T*H] f32.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/custom/device_primitives.cuh"
#include "kernels/custom/kernel_checks.cuh"
#include "kernels/custom/kernel_params.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels::custom {

inline constexpr int kCombineRowsPerBlock = 4;

// One row's merge: o and lse stored. Returns whether what it stored is not finite.
__device__ __forceinline__ bool CombineRow(const KernelParams& p, int64_t row,
                                           int tokens_per_tile) {
  const int b = static_cast<int>(row / p.rows);
  const int tiles = (p.kv_lens[b] + tokens_per_tile - 1) / tokens_per_tile;
  const int n = min(p.splits, (tiles + p.tiles_per_split - 1) / p.tiles_per_split);

  float mx = -INFINITY;
  for (int k = 0; k < n; ++k) mx = fmaxf(mx, p.lse_partial[k * p.rows_total + row]);
  const int d = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  if (mx != -INFINITY) {
    for (int k = 0; k < n; ++k) {
      const int64_t prow = k * p.rows_total + row;
      // A split that saw nothing has lse = -inf: weight exactly 0 (its o is 0, not NaN).
      const float w = expf(p.lse_partial[prow] - mx);
      const float4 v = *reinterpret_cast<const float4*>(p.o_partial + prow * kHeadDimV + d);
      sum += w;
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  const float inv = (sum > 0.f ? 1.f / sum : 0.f) * p.o_scale;  // o_scale: 1 for a bf16 pool
  __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&lo);
  packed.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p.o + row * kHeadDimV + d) = packed;
  const float lse = sum > 0.f ? mx + logf(sum) : -INFINITY;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row] = lse;
  return NonFiniteBf16Pair(packed.x) || NonFiniteBf16Pair(packed.y) ||
         (threadIdx.x == 0 && !isfinite(lse));
}

__global__ void __launch_bounds__(128 * kCombineRowsPerBlock)
    CombineSplitsKernel(const KernelParams p, int tokens_per_tile) {
  // Launched as a programmatic dependent of the fused kernel: its partials are complete and
  // visible only after this (a no-op after an ordinary launch).
  WaitForPrimaryGrid();
  if (SkipLaunch(p)) return;
  const int64_t row = int64_t{blockIdx.x} * kCombineRowsPerBlock + threadIdx.y;
  // With the op's checks, a call the fused kernel found bad (or not this step's) is not merged;
  // every block still reaches FinishCta, whose last one writes the call's verdict.
  const bool merge =
      row < p.rows_total &&
      !(ChecksOn(p) && *reinterpret_cast<volatile const unsigned*>(p.checks.words) != 0);
  if (merge && CombineRow(p, row, tokens_per_tile)) Report(p, kVerdictNonFinite);
  FinishCta(p, true);
}

}  // namespace verifyd::kernels::custom
