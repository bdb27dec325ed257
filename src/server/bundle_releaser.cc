#include "src/server/bundle_releaser.h"

#include <utility>

namespace verifyd {

BundleReleaser::BundleReleaser() : thread_([this] { Loop(); }) {}

BundleReleaser::~BundleReleaser() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void BundleReleaser::Release(std::shared_ptr<PreparedBundle> b) {
  if (b == nullptr) return;
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(b));
}

void BundleReleaser::Loop() {
  std::vector<std::shared_ptr<PreparedBundle>> batch;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BundleReleaser* r)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->stop_ || !r->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left
      batch.swap(queue_);
    }
    batch.clear();  // outside the lock: a release may take a while
  }
}

}  // namespace verifyd
