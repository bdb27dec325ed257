#pragma once
// Pinned host slots for the outcome of the input checks made on a GPU (InputCheckStatus, 16
// bytes): one per bundle checked there, from its upload until its outcome is read. The outcome
// is copied into its slot on the served stream, so reading it needs no wait of its own.

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/reference/input_check_kernels.h"

namespace verifyd {

class CheckSlots {
 public:
  CheckSlots() = default;
  CheckSlots(const CheckSlots&) = delete;
  CheckSlots& operator=(const CheckSlots&) = delete;
  ~CheckSlots();

  // Allocates `n` slots on the current device's context (cudaHostAlloc).
  cudaError_t Init(size_t n);
  // A free slot, or null when all are taken (the caller then reads its outcome with a copy of
  // its own).
  kernels::InputCheckStatus* Acquire() ABSL_LOCKS_EXCLUDED(mu_);
  void Release(kernels::InputCheckStatus* slot) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  kernels::InputCheckStatus* base_ = nullptr;
  absl::Mutex mu_;
  std::vector<kernels::InputCheckStatus*> free_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
