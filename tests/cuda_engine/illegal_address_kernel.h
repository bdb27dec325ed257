#pragma once
// A kernel that writes through a bad pointer: the sticky-error test's way to lose the context.

#include <cuda_runtime.h>

namespace verifyd::testing_kernels {

// Launches one thread that stores to an unmapped device address on `stream`.
cudaError_t LaunchIllegalWrite(cudaStream_t stream);

}  // namespace verifyd::testing_kernels
