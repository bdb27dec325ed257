#include "kernels/reference/reference_attention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/reference/reference_plan.h"

namespace verifyd::kernels {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kSoftmaxThreads = 256;

// kbuf [n_req, Lp, 576] bf16 <- the K rows of requests b0.. in token order; rows at or past
// kv_lens[b] are zero so that the padded GEMM columns add nothing (0 * NaN would not).
template <typename Vec>
__global__ void GatherKvKernel(const uint16_t* __restrict__ kv_pool,
                               const int32_t* __restrict__ kv_indptr,
                               const int32_t* __restrict__ kv_indices,
                               const int32_t* __restrict__ kv_lens, int b0, int page_shift,
                               int64_t kv_stride, uint16_t* __restrict__ kbuf) {
  constexpr int kVecPerRow = kHeadDimQK * 2 / sizeof(Vec);
  const int req = blockIdx.y;
  const int b = b0 + req;
  const int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (e >= kv_stride * kVecPerRow) return;
  const int64_t t = e / kVecPerRow;
  const int c = static_cast<int>(e % kVecPerRow);
  Vec* dst = reinterpret_cast<Vec*>(kbuf + (int64_t{req} * kv_stride + t) * kHeadDimQK) + c;
  if (t < kv_lens[b]) {
    const int64_t page = kv_indices[kv_indptr[b] + (t >> page_shift)];
    const int64_t slot = (page << page_shift) + (t & ((int64_t{1} << page_shift) - 1));
    *dst = reinterpret_cast<const Vec*>(kv_pool + slot * kHeadDimQK)[c];
  } else {
    *dst = Vec{};
  }
}

struct MaxSum {
  float max;
  float sum;  // sum of exp(s - max)
};

__device__ __forceinline__ MaxSum Merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.f};  // both empty; avoids -inf - -inf
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

__device__ __forceinline__ bool TailVisible(const uint8_t* mask_row, MaskFormat fmt, int j) {
  return fmt == MaskFormat::kBytes ? mask_row[j] != 0 : ((mask_row[j >> 3] >> (j & 7)) & 1) != 0;
}

struct SoftmaxArgs {
  const float* scores;  // fp32 [n_req, rows, Lp] (rows of this chunk)
  uint16_t* probs;      // bf16 [n_req, rows, Lp]
  float* lse;           // fp32 [B*T*H] or null
  const int32_t* kv_lens;
  const uint8_t* tree_mask;
  MaskFormat mask_format;
  int64_t mask_row_bytes;
  int draft, heads;
  int b0;
  int64_t r0;         // first query row of the chunk inside a request's T*H rows
  int64_t rows;       // query rows per request in this chunk
  int64_t kv_stride;  // Lp
  float sm_scale;
};

// One block per query row (b, t, h): probabilities of the visible keys, zero elsewhere.
// Prefix keys are all visible; tail key j is visible when tree_mask[b, t, j] is set.
// A row that sees nothing gets zero probabilities and lse = -inf.
__global__ void __launch_bounds__(kSoftmaxThreads) MaskedSoftmaxKernel(SoftmaxArgs a) {
  const int req = blockIdx.y;
  const int b = a.b0 + req;
  const int64_t r = blockIdx.x;
  const int64_t m = a.r0 + r;  // row inside the request: t * H + h
  const int t = static_cast<int>(m / a.heads);
  const int64_t kv_len = min(int64_t{a.kv_lens[b]}, a.kv_stride);
  const int64_t prefix = int64_t{a.kv_lens[b]} - a.draft;
  const uint8_t* mask_row = a.tree_mask + (int64_t{b} * a.draft + t) * a.mask_row_bytes;
  const int64_t offset = (int64_t{req} * a.rows + r) * a.kv_stride;
  const float* srow = a.scores + offset;
  uint16_t* prow = a.probs + offset;

  auto visible = [&](int64_t j) {
    return j < kv_len && (j < prefix || TailVisible(mask_row, a.mask_format, int(j - prefix)));
  };

  // Pass 1: per-thread running max and sum, four keys at a time (Lp is a multiple of 32).
  MaxSum st{-INFINITY, 0.f};
  bool any = false;
  for (int64_t j0 = int64_t{threadIdx.x} * 4; j0 < kv_len; j0 += 4 * kSoftmaxThreads) {
    const float4 s4 = *reinterpret_cast<const float4*>(srow + j0);
    const float sv[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (!visible(j0 + k)) continue;
      any = true;
      st = Merge(st, MaxSum{a.sm_scale * sv[k], 1.f});
    }
  }

  __shared__ MaxSum warp_st[kSoftmaxThreads / 32];
  __shared__ int warp_any[kSoftmaxThreads / 32];
  __shared__ MaxSum row_st;
  __shared__ int row_any;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int off = 16; off > 0; off /= 2) {
    MaxSum o{__shfl_down_sync(0xffffffffu, st.max, off),
             __shfl_down_sync(0xffffffffu, st.sum, off)};
    st = Merge(st, o);
  }
  const int warp_has = __any_sync(0xffffffffu, any);
  if (lane == 0) {
    warp_st[warp] = st;
    warp_any[warp] = warp_has;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total{-INFINITY, 0.f};
    int has = 0;
    for (int w = 0; w < kSoftmaxThreads / 32; ++w) {
      total = Merge(total, warp_st[w]);
      has |= warp_any[w];
    }
    row_st = total;
    row_any = has;
    if (a.lse != nullptr) {
      a.lse[int64_t{b} * a.draft * a.heads + m] = has ? total.max + logf(total.sum) : -INFINITY;
    }
  }
  __syncthreads();
  const MaxSum total = row_st;
  const bool row_sees = row_any != 0;
  const float inv_sum = 1.f / total.sum;

  // Pass 2: normalized probabilities, zero for hidden and padded keys.
  for (int64_t j0 = int64_t{threadIdx.x} * 4; j0 < a.kv_stride; j0 += 4 * kSoftmaxThreads) {
    float pv[4] = {0.f, 0.f, 0.f, 0.f};
    if (row_sees && j0 < kv_len) {
      const float4 s4 = *reinterpret_cast<const float4*>(srow + j0);
      const float sv[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (visible(j0 + k)) pv[k] = expf(a.sm_scale * sv[k] - total.max) * inv_sum;
      }
    }
    __nv_bfloat162 lo = __floats2bfloat162_rn(pv[0], pv[1]);
    __nv_bfloat162 hi = __floats2bfloat162_rn(pv[2], pv[3]);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(prow + j0) = packed;
  }
}

int Log2(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

cudaError_t FromCublas(cublasStatus_t st) {
  switch (st) {
    case CUBLAS_STATUS_SUCCESS:
      return cudaSuccess;
    case CUBLAS_STATUS_ALLOC_FAILED:
      return cudaErrorMemoryAllocation;
    case CUBLAS_STATUS_INVALID_VALUE:
      return cudaErrorInvalidValue;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return cudaErrorNotSupported;
    default: {
      // An execution failure leaves its CUDA error behind; report that one when there is one.
      const cudaError_t e = cudaGetLastError();
      return e != cudaSuccess ? e : cudaErrorUnknown;
    }
  }
}

}  // namespace

size_t ReferenceWorkspaceBytes(const VerifyProblem& p) { return PlanReference(p).total_bytes; }

cudaError_t LaunchReference(const VerifyProblem& p, void* workspace, size_t workspace_bytes,
                            cublasHandle_t handle, cudaStream_t stream) {
  return LaunchReferencePlanned(p, PlanReference(p), workspace, workspace_bytes, handle, stream);
}

cudaError_t LaunchReferencePlanned(const VerifyProblem& p, const ReferencePlan& plan,
                                   void* workspace, size_t workspace_bytes, cublasHandle_t handle,
                                   cudaStream_t stream) {
  const ProblemShape& s = p.shape;
  if (!CheckShape(s).empty() || p.q == nullptr || p.kv_pool == nullptr || p.o == nullptr ||
      p.kv_indptr == nullptr || p.kv_indices == nullptr || p.kv_lens == nullptr ||
      p.tree_mask == nullptr || p.max_kv_len < s.draft || plan.requests < 1 || plan.rows < 1 ||
      plan.kv_stride < p.max_kv_len || workspace == nullptr || workspace_bytes < plan.total_bytes ||
      !(p.o_scale > 0.f && std::isfinite(p.o_scale))) {
    return cudaErrorInvalidValue;
  }
  auto* ws = static_cast<char*>(workspace);
  auto* kbuf = reinterpret_cast<uint16_t*>(ws + plan.k_offset);
  auto* scores = reinterpret_cast<float*>(ws + plan.s_offset);
  auto* probs = reinterpret_cast<uint16_t*>(ws + plan.p_offset);

  // SetStream resets the workspace to cuBLAS's own pool, so ours is set after it.
  if (cublasStatus_t st = cublasSetStream(handle, stream); st != CUBLAS_STATUS_SUCCESS) {
    return FromCublas(st);
  }
  if (cublasStatus_t st =
          cublasSetWorkspace(handle, ws + plan.cublas_offset, kReferenceCublasWorkspace);
      st != CUBLAS_STATUS_SUCCESS) {
    return FromCublas(st);
  }

  const int64_t lp = plan.kv_stride;
  const int64_t m_total = plan.rows_total;
  const int page_shift = Log2(s.page_size);
  const bool aligned16 = reinterpret_cast<uintptr_t>(p.kv_pool) % 16 == 0;
  const float one = 1.f, zero = 0.f;

  for (int b0 = 0; b0 < s.batch; b0 += plan.requests) {
    const int n_req = std::min(plan.requests, s.batch - b0);
    const int64_t vec_per_row = aligned16 ? kHeadDimQK * 2 / 16 : kHeadDimQK;
    const dim3 gather_grid(
        static_cast<unsigned>((lp * vec_per_row + kGatherThreads - 1) / kGatherThreads), n_req);
    if (aligned16) {
      GatherKvKernel<uint4><<<gather_grid, kGatherThreads, 0, stream>>>(
          p.kv_pool, p.kv_indptr, p.kv_indices, p.kv_lens, b0, page_shift, lp, kbuf);
    } else {
      GatherKvKernel<uint16_t><<<gather_grid, kGatherThreads, 0, stream>>>(
          p.kv_pool, p.kv_indptr, p.kv_indices, p.kv_lens, b0, page_shift, lp, kbuf);
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

    for (int64_t r0 = 0; r0 < m_total; r0 += plan.rows) {
      const int64_t rows = std::min(plan.rows, m_total - r0);
      // Row-major S [rows, Lp] = Q [rows, 576] K^T, i.e. column-major S^T = K^T(op T) Q^T.
      const uint16_t* q0 = p.q + (int64_t{b0} * m_total + r0) * kHeadDimQK;
      cublasStatus_t st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(lp), static_cast<int>(rows),
          kHeadDimQK, &one, kbuf, CUDA_R_16BF, kHeadDimQK, lp * kHeadDimQK, q0, CUDA_R_16BF,
          kHeadDimQK, m_total * kHeadDimQK, &zero, scores, CUDA_R_32F, static_cast<int>(lp),
          rows * lp, n_req, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) return FromCublas(st);

      const SoftmaxArgs args{scores,
                             probs,
                             p.lse,
                             p.kv_lens,
                             p.tree_mask,
                             s.mask_format,
                             MaskRowBytes(s.mask_format, s.draft),
                             s.draft,
                             s.heads,
                             b0,
                             r0,
                             rows,
                             lp,
                             p.sm_scale};
      MaskedSoftmaxKernel<<<dim3(static_cast<unsigned>(rows), n_req), kSoftmaxThreads, 0, stream>>>(
          args);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

      // Row-major O [rows, 512] = o_scale P [rows, Lp] V [Lp, 512]; V is K's first 512 dims
      // (ld 576). o_scale (a dequantised e4m3 pool's kv_scale) goes on in fp32, before o's
      // one rounding.
      uint16_t* o0 = p.o + (int64_t{b0} * m_total + r0) * kHeadDimV;
      st = cublasGemmStridedBatchedEx(
          handle, CUBLAS_OP_N, CUBLAS_OP_N, kHeadDimV, static_cast<int>(rows), static_cast<int>(lp),
          &p.o_scale, kbuf, CUDA_R_16BF, kHeadDimQK, lp * kHeadDimQK, probs, CUDA_R_16BF,
          static_cast<int>(lp), rows * lp, &zero, o0, CUDA_R_16BF, kHeadDimV, m_total * kHeadDimV,
          n_req, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) return FromCublas(st);
    }
  }
  return cudaSuccess;
}

}  // namespace verifyd::kernels
