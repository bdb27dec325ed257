#pragma once
// CUDA errors as absl::Status. A sticky error (the context is lost: illegal address, launch
// failure, ...) is DATA_LOSS so that the server can mark itself NOT_SERVING and exit; any other
// CUDA error is INTERNAL, an out-of-memory RESOURCE_EXHAUSTED.

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace verifyd {

// Whether `e` leaves the CUDA context unusable for the rest of the process.
bool IsStickyCudaError(cudaError_t e);

// OK for cudaSuccess; otherwise a status naming the error and `where` ("custom path").
// Clears a non-sticky error from the runtime's last-error slot so that it does not leak into
// the next call; *sticky (optional) tells whether the context is lost.
absl::Status CudaStatus(cudaError_t e, absl::string_view where, int device, bool* sticky = nullptr);

}  // namespace verifyd
