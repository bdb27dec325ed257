#pragma once
// The served output's finite check: one pass over a path's o (and lse) that leaves a flag on the
// device, so that only four bytes come back to the host; or, as it copies the output to where the
// call wants it, a flag in mapped host memory, so that nothing comes back at all.

#include <cuda_runtime.h>

#include <cstdint>

namespace verifyd::kernels {

// Sets *flag to nonzero when o bf16 [n] holds a NaN or an Inf, or lse fp32 [n_lse] (null when
// n_lse is 0) holds a NaN or +Inf (-Inf is the lse of a row that sees no key). Never clears
// *flag: zero it on `stream` first.
cudaError_t LaunchFlagNonFinite(const uint16_t* o, int64_t n, const float* lse, int64_t n_lse,
                                unsigned* flag, cudaStream_t stream);

// The same check while copying o to o_to and lse to lse_to (device memory; lse_to may be null):
// stores 1 into *flag (a plain store, so that `flag` may be mapped host memory) when the output
// is not finite, and never clears it. The copy is made either way.
cudaError_t LaunchFlagNonFiniteAndCopy(const uint16_t* o, uint16_t* o_to, int64_t n,
                                       const float* lse, float* lse_to, int64_t n_lse,
                                       unsigned* flag, cudaStream_t stream);

}  // namespace verifyd::kernels
