#pragma once
// The CUDA events of one lane's calls, kept between them: a call takes the events it records
// and gives them back when its bundle goes, so that serving a call creates and destroys none.
// An event given back may still have a record pending; whoever takes it next records it again,
// which a wait already queued on it does not see (a stream waits for the record it was given).

#include <cuda_runtime.h>

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace verifyd {

class EventPool {
 public:
  enum class Kind { kTiming, kOrdering };  // with timestamps, or cudaEventDisableTiming

  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool();  // destroys the events it keeps

  // A kept event of that kind, or a new one.
  cudaError_t Take(Kind kind, cudaEvent_t* e) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `e` (taken as `kind`) for the next Take; null is ignored.
  void Give(Kind kind, cudaEvent_t e) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::vector<cudaEvent_t> kept_[2] ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
