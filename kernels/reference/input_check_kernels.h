#pragma once
// The checks of a call's page ids and tree mask where they lie in device memory (a CUDA IPC or
// VMM region): one pass that copies them into verifyd's own allocation, so that the kernels read
// a snapshot the client can no longer change, and records the first bad entry of each. Only 16
// bytes come back to the host, instead of the tensors.

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// The first bad entry of each tensor: (position << 32) | its value (a page id's 32 bits, or
// the mask byte), or kNoBadEntry. Initialise both to kNoBadEntry on the device before the launch.
struct InputCheckStatus {
  unsigned long long bad_index;  // in kv_indices: a page id outside [0, num_pages)
  unsigned long long bad_mask;   // in tree_mask: a byte past 1, or bits past T in a packed row
};
inline constexpr unsigned long long kNoBadEntry = ~0ull;

// Copies kv_indices [n] to `indices_out`, each page id outside [0, num_pages) replaced by 0 (so
// that no kernel reads outside the pool), and tree_mask [mask_bytes] (rows of
// MaskRowBytes(format, draft) bytes) to `mask_out` unchanged; lowers status's positions to the
// first bad entry of each. n and mask_bytes are below 2^32.
cudaError_t LaunchCheckedInputCopy(const int32_t* indices, int64_t n, int64_t num_pages,
                                   int32_t* indices_out, const uint8_t* mask, int64_t mask_bytes,
                                   MaskFormat format, int draft, uint8_t* mask_out,
                                   InputCheckStatus* status, cudaStream_t stream);

}  // namespace verifyd::kernels
