#include "src/cuda_engine/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace verifyd {

bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

absl::Status CudaStatus(cudaError_t e, absl::string_view where, int device, bool* sticky) {
  if (sticky != nullptr) *sticky = false;
  if (e == cudaSuccess) return absl::OkStatus();
  // A non-sticky error is cleared by reading it; a sticky one stays and is seen again.
  cudaGetLastError();
  const bool lost = IsStickyCudaError(e) || cudaPeekAtLastError() != cudaSuccess;
  if (sticky != nullptr) *sticky = lost;
  const std::string what =
      absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ") on device ", device);
  if (lost) {
    return absl::DataLossError(
        absl::StrCat("sticky CUDA error ", what, " in ", where, ": the CUDA context is lost"));
  }
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": CUDA error ", what));
  }
  return absl::InternalError(absl::StrCat(where, ": CUDA error ", what));
}

}  // namespace verifyd
