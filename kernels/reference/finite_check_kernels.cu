#include "kernels/reference/finite_check_kernels.h"

#include <cstdint>

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// All exponent bits set: Inf or NaN, for each bf16 half of a 32-bit word.
__device__ __forceinline__ bool PairNonFinite(uint32_t w) {
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

// One pass over o bf16 [n] and lse fp32 [n_lse]; with kCopy, each value also goes to o_to (and to
// lse_to when it is not null). Every writer of the flag stores 1, so a plain store serves device
// and mapped host memory alike.
template <bool kCopy>
__global__ void __launch_bounds__(kThreads)
    FlagNonFiniteKernel(const uint16_t* o, uint16_t* o_to, int64_t n, bool vector, const float* lse,
                        float* lse_to, int64_t n_lse, volatile unsigned* flag) {
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  bool bad = false;
  int64_t scalar_from = 0;
  if (vector) {  // 8 bf16 per 16-byte load (and store)
    const uint4* o8 = reinterpret_cast<const uint4*>(o);
    const int64_t n8 = n / 8;
    for (int64_t i = first; i < n8; i += stride) {
      const uint4 w = o8[i];
      if constexpr (kCopy) reinterpret_cast<uint4*>(o_to)[i] = w;
      bad |= PairNonFinite(w.x) | PairNonFinite(w.y) | PairNonFinite(w.z) | PairNonFinite(w.w);
    }
    scalar_from = n8 * 8;
  }
  for (int64_t i = scalar_from + first; i < n; i += stride) {
    const uint16_t h = o[i];
    if constexpr (kCopy) o_to[i] = h;
    bad |= (h & 0x7f80u) == 0x7f80u;
  }
  for (int64_t i = first; i < n_lse; i += stride) {
    const float x = lse[i];
    if constexpr (kCopy) {
      if (lse_to != nullptr) lse_to[i] = x;
    }
    bad |= isnan(x) || x == INFINITY;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1u;
}

template <bool kCopy>
cudaError_t Launch(const uint16_t* o, uint16_t* o_to, int64_t n, const float* lse, float* lse_to,
                   int64_t n_lse, unsigned* flag, cudaStream_t stream) {
  if (n <= 0 && n_lse <= 0) return cudaSuccess;
  const bool vector = reinterpret_cast<uintptr_t>(o) % 16 == 0 &&
                      (!kCopy || reinterpret_cast<uintptr_t>(o_to) % 16 == 0);
  const int64_t work = (vector ? n / 8 : n) > n_lse ? (vector ? n / 8 : n) : n_lse;
  const int64_t want = (work + kThreads - 1) / kThreads;
  const unsigned blocks =
      static_cast<unsigned>(want < 1 ? 1 : (want > kMaxBlocks ? kMaxBlocks : want));
  FlagNonFiniteKernel<kCopy>
      <<<blocks, kThreads, 0, stream>>>(o, o_to, n, vector, lse, lse_to, n_lse, flag);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFlagNonFinite(const uint16_t* o, int64_t n, const float* lse, int64_t n_lse,
                                unsigned* flag, cudaStream_t stream) {
  return Launch<false>(o, nullptr, n, lse, nullptr, n_lse, flag, stream);
}

cudaError_t LaunchFlagNonFiniteAndCopy(const uint16_t* o, uint16_t* o_to, int64_t n,
                                       const float* lse, float* lse_to, int64_t n_lse,
                                       unsigned* flag, cudaStream_t stream) {
  return Launch<true>(o, o_to, n, lse, lse_to, n_lse, flag, stream);
}

}  // namespace verifyd::kernels
