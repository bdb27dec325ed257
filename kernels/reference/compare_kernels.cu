#include "kernels/reference/compare_kernels.h"

#include <cmath>

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kLanes = 32;
constexpr int kWarps = kThreads / kLanes;
constexpr int kMaxBlocks = 512;
constexpr unsigned kFullMask = 0xffffffffu;

struct Partial {
  double diff_sq, ref_sq, max_abs, lse_max_abs, max_row_rel_l2;
  long long worst_row;
  long long beyond_tol, nan_test, inf_test, nan_ref, inf_ref, zero_row_breaches;
};

__device__ __forceinline__ Partial Empty() {
  Partial p{};
  p.worst_row = -1;
  return p;
}

// Keeps the larger row rel-L2; on a tie the lower row, as the host's first-wins scan does.
__device__ __forceinline__ void TakeWorse(Partial& a, double rel, long long row) {
  if (row < 0) return;
  if (a.worst_row < 0 || rel > a.max_row_rel_l2 || (rel == a.max_row_rel_l2 && row < a.worst_row)) {
    a.max_row_rel_l2 = rel;
    a.worst_row = row;
  }
}

__device__ __forceinline__ void Add(Partial& a, const Partial& b) {
  a.diff_sq += b.diff_sq;
  a.ref_sq += b.ref_sq;
  a.max_abs = fmax(a.max_abs, b.max_abs);
  a.lse_max_abs = fmax(a.lse_max_abs, b.lse_max_abs);
  TakeWorse(a, b.max_row_rel_l2, b.worst_row);
  a.beyond_tol += b.beyond_tol;
  a.nan_test += b.nan_test;
  a.inf_test += b.inf_test;
  a.nan_ref += b.nan_ref;
  a.inf_ref += b.inf_ref;
  a.zero_row_breaches += b.zero_row_breaches;
}

__device__ __forceinline__ double Load(const void* p, ElemType t, int64_t i) {
  if (t == ElemType::kF32) return static_cast<const float*>(p)[i];
  const unsigned bits = static_cast<unsigned>(static_cast<const unsigned short*>(p)[i]) << 16;
  return __uint_as_float(bits);
}

// The lane sums of one warp combined by an xor butterfly; every lane gets the same total.
__device__ __forceinline__ double WarpSum(double x) {
  for (int off = kLanes / 2; off > 0; off /= 2) {
    x = __dadd_rn(x, __shfl_xor_sync(kFullMask, x, off));
  }
  return x;
}

// Tree reduction of one Partial per thread into s[0]; every thread must call it.
__device__ void BlockReduce(Partial* s, Partial mine) {
  s[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) Add(s[threadIdx.x], s[threadIdx.x + stride]);
    __syncthreads();
  }
}

struct Args {
  DeviceValues test, ref;
  int64_t n;
  const float* test_lse;
  const float* ref_lse;
  int64_t n_lse;
  CompareLimits lim;
};

// partials [gridDim.x]: each block's sums over a grid-stride share of the rows, one warp per row.
// Products and sums use explicit rounding (no fused multiply-add) so that the row sums and
// limits equal the host's.
__global__ void __launch_bounds__(kThreads) ComparePartialKernel(Args a, Partial* partials) {
  Partial p = Empty();
  const int lane = threadIdx.x % kLanes;
  const int64_t L = a.lim.row_len;
  const int64_t rows = (a.n + L - 1) / L;
  const int64_t warps = int64_t{gridDim.x} * kWarps;
  for (int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / kLanes; row < rows;
       row += warps) {
    const int64_t begin = row * L;
    const int64_t m = a.n - begin < L ? a.n - begin : L;
    double e2 = 0, r2 = 0;
    for (int64_t k = lane; k < m; k += kLanes) {
      const double t = Load(a.test.data, a.test.type, begin + k);
      const double r = Load(a.ref.data, a.ref.type, begin + k);
      p.nan_test += isnan(t);
      p.inf_test += isinf(t);
      p.nan_ref += isnan(r);
      p.inf_ref += isinf(r);
      if (!isfinite(t) || !isfinite(r)) {
        const bool same = (isnan(t) && isnan(r)) || (isinf(t) && t == r);
        if (!same) {
          ++p.beyond_tol;
          p.max_abs = INFINITY;
        }
        continue;
      }
      const double e = fabs(t - r);
      e2 = __dadd_rn(e2, __dmul_rn(e, e));
      r2 = __dadd_rn(r2, __dmul_rn(r, r));
      p.max_abs = fmax(p.max_abs, e);
    }
    e2 = WarpSum(e2);
    r2 = WarpSum(r2);
    const double rms = sqrt(r2 / static_cast<double>(m));
    const double limit = __dadd_rn(a.lim.atol, __dmul_rn(a.lim.atol_rel, rms));
    for (int64_t k = lane; k < m; k += kLanes) {
      const double t = Load(a.test.data, a.test.type, begin + k);
      const double r = Load(a.ref.data, a.ref.type, begin + k);
      if (!isfinite(t) || !isfinite(r)) continue;
      if (fabs(t - r) > __dadd_rn(limit, __dmul_rn(a.lim.rtol, fabs(r)))) ++p.beyond_tol;
    }
    if (lane == 0) {
      p.diff_sq += e2;
      p.ref_sq += r2;
      if (r2 > 0) {
        const double rel = sqrt(e2 / r2);
        if (rel > 0) TakeWorse(p, rel, row);
      } else if (e2 > 0) {
        ++p.zero_row_breaches;
      }
    }
  }
  if (a.test_lse != nullptr && a.ref_lse != nullptr) {
    const int64_t stride = int64_t{gridDim.x} * kThreads;
    for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < a.n_lse; i += stride) {
      const double t = a.test_lse[i], r = a.ref_lse[i];
      double d;
      if (t == r) {
        d = 0;  // both -inf: rows that see nothing
      } else if (!isfinite(t) || !isfinite(r)) {
        d = INFINITY;
      } else {
        d = fabs(t - r);
      }
      p.lse_max_abs = fmax(p.lse_max_abs, d);
    }
  }
  __shared__ Partial s[kThreads];
  BlockReduce(s, p);
  if (threadIdx.x == 0) partials[blockIdx.x] = s[0];
}

__global__ void __launch_bounds__(kThreads)
    CompareFinalKernel(const Partial* partials, int num_partials, int64_t n, int64_t rows,
                       bool has_lse, DeviceDiffStats* out) {
  Partial p = Empty();
  for (int i = threadIdx.x; i < num_partials; i += kThreads) Add(p, partials[i]);
  __shared__ Partial s[kThreads];
  BlockReduce(s, p);
  if (threadIdx.x != 0) return;
  const Partial& t = s[0];
  DeviceDiffStats d;
  d.count = n;
  // mse(test, ref) / mse(ref, 0) with 0/0 = 0 and x/0 = inf.
  d.nmse = t.ref_sq > 0 ? t.diff_sq / t.ref_sq : (t.diff_sq > 0 ? INFINITY : 0.0);
  d.rel_l2 = sqrt(d.nmse);
  d.max_abs = t.max_abs;
  d.beyond_tol = t.beyond_tol;
  d.nan_test = t.nan_test;
  d.inf_test = t.inf_test;
  d.nan_ref = t.nan_ref;
  d.inf_ref = t.inf_ref;
  d.lse_max_abs = has_lse ? t.lse_max_abs : NAN;
  d.rows = rows;
  d.max_row_rel_l2 = t.worst_row < 0 ? 0.0 : t.max_row_rel_l2;
  d.worst_row = t.worst_row;
  d.zero_row_breaches = t.zero_row_breaches;
  *out = d;
}

int NumBlocks(int64_t rows, int64_t n_lse) {
  const int64_t for_rows = (rows + kWarps - 1) / kWarps;
  const int64_t for_lse = (n_lse + 4 * kThreads - 1) / (4 * kThreads);
  const int64_t want = for_rows > for_lse ? for_rows : for_lse;
  return static_cast<int>(want < 1 ? 1 : (want > kMaxBlocks ? kMaxBlocks : want));
}

}  // namespace

size_t CompareWorkspaceBytes() { return sizeof(Partial) * kMaxBlocks; }

cudaError_t LaunchCompare(DeviceValues test, DeviceValues ref, int64_t n, const float* test_lse,
                          const float* ref_lse, int64_t n_lse, const CompareLimits& limits,
                          void* workspace, size_t workspace_bytes, DeviceDiffStats* out,
                          cudaStream_t stream) {
  if (n < 0 || n_lse < 0 || limits.row_len < 1 ||
      (n > 0 && (test.data == nullptr || ref.data == nullptr)) || out == nullptr ||
      workspace == nullptr || workspace_bytes < CompareWorkspaceBytes()) {
    return cudaErrorInvalidValue;
  }
  const bool has_lse = test_lse != nullptr && ref_lse != nullptr;
  const int64_t rows = (n + limits.row_len - 1) / limits.row_len;
  const int blocks = NumBlocks(rows, has_lse ? n_lse : 0);
  auto* partials = static_cast<Partial*>(workspace);
  ComparePartialKernel<<<blocks, kThreads, 0, stream>>>(
      Args{test, ref, n, test_lse, ref_lse, n_lse, limits}, partials);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  CompareFinalKernel<<<1, kThreads, 0, stream>>>(partials, blocks, n, rows, has_lse, out);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
