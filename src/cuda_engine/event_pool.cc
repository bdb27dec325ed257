#include "src/cuda_engine/event_pool.h"

namespace verifyd {

EventPool::~EventPool() {
  absl::MutexLock lock(&mu_);
  for (auto& kept : kept_) {
    for (cudaEvent_t e : kept) cudaEventDestroy(e);
  }
  cudaGetLastError();  // nothing to report from a destructor
}

cudaError_t EventPool::Take(Kind kind, cudaEvent_t* e) {
  {
    absl::MutexLock lock(&mu_);
    std::vector<cudaEvent_t>& kept = kept_[static_cast<int>(kind)];
    if (!kept.empty()) {
      *e = kept.back();
      kept.pop_back();
      return cudaSuccess;
    }
  }
  const cudaError_t err = cudaEventCreateWithFlags(
      e, kind == Kind::kTiming ? cudaEventDefault : cudaEventDisableTiming);
  if (err != cudaSuccess) *e = nullptr;
  return err;
}

void EventPool::Give(Kind kind, cudaEvent_t e) {
  if (e == nullptr) return;
  absl::MutexLock lock(&mu_);
  kept_[static_cast<int>(kind)].push_back(e);
}

}  // namespace verifyd
