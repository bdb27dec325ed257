#include "src/cuda_engine/check_slots.h"

namespace verifyd {

CheckSlots::~CheckSlots() {
  if (base_ != nullptr) cudaFreeHost(base_);
}

cudaError_t CheckSlots::Init(size_t n) {
  void* p = nullptr;
  const cudaError_t e =
      cudaHostAlloc(&p, n * sizeof(kernels::InputCheckStatus), cudaHostAllocDefault);
  if (e != cudaSuccess) return e;
  base_ = static_cast<kernels::InputCheckStatus*>(p);
  absl::MutexLock lock(&mu_);
  free_.reserve(n);
  for (size_t i = n; i > 0; --i) free_.push_back(base_ + (i - 1));
  return cudaSuccess;
}

kernels::InputCheckStatus* CheckSlots::Acquire() {
  absl::MutexLock lock(&mu_);
  if (free_.empty()) return nullptr;
  kernels::InputCheckStatus* slot = free_.back();
  free_.pop_back();
  return slot;
}

void CheckSlots::Release(kernels::InputCheckStatus* slot) {
  if (slot == nullptr) return;
  absl::MutexLock lock(&mu_);
  free_.push_back(slot);
}

}  // namespace verifyd
