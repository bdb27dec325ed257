#include "kernels/reference/oracle_kernel.h"

#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;  // keys scored per step
constexpr int kDimsPerThread = kHeadDimV / kThreads;
static_assert(kHeadDimV % kThreads == 0);

__device__ __forceinline__ float Bf16(uint16_t v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}

// NaN-propagating max: a NaN score must reach the output rather than vanish in fmaxf.
__device__ __forceinline__ float MaxNan(float a, float b) { return (isnan(b) || b > a) ? b : a; }

// One block per query row g = (b*T + t)*H + h: online softmax over the row's visible keys in
// tiles of kTile; warps score the keys, every thread owns kDimsPerThread output dims.
__global__ void OracleKernel(VerifyProblem p, int64_t mask_row_bytes, float* o, float* lse) {
  const int64_t g = blockIdx.x;
  const int heads = p.shape.heads, draft = p.shape.draft;
  const int64_t bt = g / heads;
  const int b = static_cast<int>(bt / draft);
  const int64_t kv_len = p.kv_lens[b];
  const int64_t prefix = kv_len - draft;
  const uint8_t* mask_row = p.tree_mask + bt * mask_row_bytes;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  __shared__ float q[kHeadDimQK];
  __shared__ float s[kTile];  // scaled scores of the tile, -inf for hidden keys
  for (int d = threadIdx.x; d < kHeadDimQK; d += kThreads) q[d] = Bf16(p.q[g * kHeadDimQK + d]);
  __syncthreads();

  // Element d of key j's row, as the contract defines it (fp32).
  const bool e4m3 = p.shape.kv_dtype == KvDtype::kE4m3;
  const auto* bytes = reinterpret_cast<const uint8_t*>(p.kv_pool);
  auto kv_row = [&](int64_t j) {
    const int64_t page = p.kv_indices[p.kv_indptr[b] + j / p.shape.page_size];
    return (page * p.shape.page_size + j % p.shape.page_size) * kHeadDimQK;
  };
  auto kv = [&](int64_t row, int d) {
    if (!e4m3) return Bf16(p.kv_pool[row + d]);
    __nv_fp8_e4m3 x;
    x.__x = bytes[row + d];
    return static_cast<float>(x) * p.kv_scale;
  };
  auto visible = [&](int64_t j) {
    if (j < prefix) return true;
    const int64_t jj = j - prefix;
    return p.shape.mask_format == MaskFormat::kBytes ? mask_row[jj] != 0
                                                     : ((mask_row[jj / 8] >> (jj % 8)) & 1) != 0;
  };

  float m = -INFINITY, l = 0.f;
  float acc[kDimsPerThread] = {};
  for (int64_t j0 = 0; j0 < kv_len; j0 += kTile) {
    for (int jj = warp; jj < kTile; jj += kWarps) {
      const int64_t j = j0 + jj;
      float score = -INFINITY;
      if (j < kv_len && visible(j)) {
        const int64_t k = kv_row(j);
        float dot = 0.f;
        for (int d = lane; d < kHeadDimQK; d += 32) dot += q[d] * kv(k, d);
        for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        score = p.sm_scale * dot;
      }
      if (lane == 0) s[jj] = score;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int jj = 0; jj < kTile; ++jj) tile_max = MaxNan(tile_max, s[jj]);
    const float new_m = MaxNan(m, tile_max);
    if (new_m != -INFINITY) {
      const float f = expf(m - new_m);  // 0 while m is still -inf
      l *= f;
      for (int k = 0; k < kDimsPerThread; ++k) acc[k] *= f;
      for (int jj = 0; jj < kTile; ++jj) {
        if (s[jj] == -INFINITY) continue;
        const float pj = expf(s[jj] - new_m);
        l += pj;
        const int64_t v = kv_row(j0 + jj);
        for (int k = 0; k < kDimsPerThread; ++k) acc[k] += pj * kv(v, threadIdx.x + k * kThreads);
      }
      m = new_m;
    }
    __syncthreads();
  }

  const bool empty = m == -INFINITY;
  for (int k = 0; k < kDimsPerThread; ++k) {
    o[g * kHeadDimV + threadIdx.x + k * kThreads] = empty ? 0.f : acc[k] / l;
  }
  if (lse != nullptr && threadIdx.x == 0) lse[g] = empty ? -INFINITY : m + logf(l);
}

}  // namespace

cudaError_t LaunchOracle(const VerifyProblem& p, float* o_f32, float* lse, cudaStream_t stream) {
  if (!CheckShape(p.shape).empty() || p.q == nullptr || p.kv_pool == nullptr ||
      p.kv_indptr == nullptr || p.kv_indices == nullptr || p.kv_lens == nullptr ||
      p.tree_mask == nullptr || o_f32 == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = int64_t{p.shape.batch} * p.shape.draft * p.shape.heads;
  OracleKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      p, MaskRowBytes(p.shape.mask_format, p.shape.draft), o_f32, lse);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
