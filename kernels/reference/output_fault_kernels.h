#pragma once
// Test-only corruption of a path's bf16 output, for the engines' fault injection: the layers
// above see a real wrong output coming out of the device.

#include <cuda_runtime.h>

#include <cstdint>

namespace verifyd::kernels {

// o[i] = bf16(float(o[i]) + amount) for o bf16 [n].
cudaError_t LaunchAddToBf16(uint16_t* o, int64_t n, float amount, cudaStream_t stream);

// o[i] = NaN for o bf16 [n].
cudaError_t LaunchFillNanBf16(uint16_t* o, int64_t n, cudaStream_t stream);

}  // namespace verifyd::kernels
