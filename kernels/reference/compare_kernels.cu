#include "kernels/reference/compare_kernels.h"

#include <cmath>

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 512;

struct Partial {
  double diff_sq, ref_sq, max_abs, lse_max_abs;
  long long beyond_tol, nan_test, inf_test, nan_ref, inf_ref;
};

__device__ __forceinline__ void Add(Partial& a, const Partial& b) {
  a.diff_sq += b.diff_sq;
  a.ref_sq += b.ref_sq;
  a.max_abs = fmax(a.max_abs, b.max_abs);
  a.lse_max_abs = fmax(a.lse_max_abs, b.lse_max_abs);
  a.beyond_tol += b.beyond_tol;
  a.nan_test += b.nan_test;
  a.inf_test += b.inf_test;
  a.nan_ref += b.nan_ref;
  a.inf_ref += b.inf_ref;
}

__device__ __forceinline__ double Load(const void* p, ElemType t, int64_t i) {
  if (t == ElemType::kF32) return static_cast<const float*>(p)[i];
  const unsigned bits = static_cast<unsigned>(static_cast<const unsigned short*>(p)[i]) << 16;
  return __uint_as_float(bits);
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
  double atol, rtol;
};

// partials [gridDim.x]: each block's sums over a grid-stride share of the elements.
__global__ void __launch_bounds__(kThreads) ComparePartialKernel(Args a, Partial* partials) {
  Partial p{};
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < a.n; i += stride) {
    const double t = Load(a.test.data, a.test.type, i);
    const double r = Load(a.ref.data, a.ref.type, i);
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
    p.diff_sq += e * e;
    p.ref_sq += r * r;
    p.max_abs = fmax(p.max_abs, e);
    if (e > a.atol + a.rtol * fabs(r)) ++p.beyond_tol;
  }
  if (a.test_lse != nullptr && a.ref_lse != nullptr) {
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
    CompareFinalKernel(const Partial* partials, int num_partials, int64_t n, bool has_lse,
                       DeviceDiffStats* out) {
  Partial p{};
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
  *out = d;
}

int NumBlocks(int64_t n) {
  const int64_t want = (n + 4 * kThreads - 1) / (4 * kThreads);
  return static_cast<int>(want < 1 ? 1 : (want > kMaxBlocks ? kMaxBlocks : want));
}

}  // namespace

size_t CompareWorkspaceBytes() { return sizeof(Partial) * kMaxBlocks; }

cudaError_t LaunchCompare(DeviceValues test, DeviceValues ref, int64_t n, const float* test_lse,
                          const float* ref_lse, int64_t n_lse, double atol, double rtol,
                          void* workspace, size_t workspace_bytes, DeviceDiffStats* out,
                          cudaStream_t stream) {
  if (n < 0 || n_lse < 0 || (n > 0 && (test.data == nullptr || ref.data == nullptr)) ||
      out == nullptr || workspace == nullptr || workspace_bytes < CompareWorkspaceBytes()) {
    return cudaErrorInvalidValue;
  }
  const bool has_lse = test_lse != nullptr && ref_lse != nullptr;
  const int blocks = NumBlocks(n > n_lse ? n : n_lse);
  auto* partials = static_cast<Partial*>(workspace);
  ComparePartialKernel<<<blocks, kThreads, 0, stream>>>(
      Args{test, ref, n, test_lse, ref_lse, n_lse, atol, rtol}, partials);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  CompareFinalKernel<<<1, kThreads, 0, stream>>>(partials, blocks, n, has_lse, out);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
