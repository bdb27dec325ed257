#pragma once
// Gives prepared bundles back on a thread of its own: a call whose answer a GPU stream waits for
// (a doorbell call) answers first, and its bundle's device memory and events (about ten CUDA
// calls on the CUDA engine) are released beside the next call instead of before the answer.

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "src/engine/engine.h"

namespace verifyd {

class BundleReleaser {
 public:
  BundleReleaser();
  BundleReleaser(const BundleReleaser&) = delete;
  BundleReleaser& operator=(const BundleReleaser&) = delete;
  ~BundleReleaser();  // releases what is queued, then joins

  // Drops `b` on the releaser's thread (where its last reference goes, unless another holder,
  // such as a deferred comparison, still has one).
  void Release(std::shared_ptr<PreparedBundle> b) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  absl::Mutex mu_;
  std::vector<std::shared_ptr<PreparedBundle>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace verifyd
