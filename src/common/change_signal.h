#pragma once
// A generation number that waiters can sleep on: one side calls Notify() when something changed,
// the other WaitFor()s a change past the generation it last saw. Its lock is a leaf (nothing is
// called while it is held), so Notify() is safe from under any other lock.

#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace verifyd {

class ChangeSignal {
 public:
  void Notify() {
    absl::MutexLock l(&mu_);
    ++generation_;
  }
  uint64_t generation() const {
    absl::MutexLock l(&mu_);
    return generation_;
  }
  // Returns the generation once it differs from `seen`, or after `timeout` (then it may equal
  // `seen`).
  uint64_t WaitFor(uint64_t seen, absl::Duration timeout) const {
    absl::MutexLock l(&mu_);
    const auto changed = [this, seen]()
                             ABSL_SHARED_LOCKS_REQUIRED(mu_) { return generation_ != seen; };
    mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
    return generation_;
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace verifyd
