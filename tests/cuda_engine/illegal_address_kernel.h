#pragma once
// Kernels that make the CUDA context unusable: the sticky-error test's way to lose it.

#include <cuda_runtime.h>

namespace verifyd::testing_kernels {

// Stores through an address outside the GPU's virtual address space on `stream` and waits; if
// that did not fault (some address spaces map everything), traps. Returns the sticky error seen.
cudaError_t LoseContext(cudaStream_t stream);

}  // namespace verifyd::testing_kernels
