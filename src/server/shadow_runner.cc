#include "src/server/shadow_runner.h"

namespace verifyd {

ShadowRunner::ShadowRunner(int threads, int capacity) {
  queue_.set_capacity(capacity);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
}

ShadowRunner::~ShadowRunner() {
  WaitIdle();
  // An empty job tells a worker to stop.
  for (size_t i = 0; i < workers_.size(); ++i) queue_.push(nullptr);
  for (auto& t : workers_) t.join();
}

bool ShadowRunner::TrySubmit(std::function<void()> job) {
  pending_.fetch_add(1);
  if (!queue_.try_push(std::move(job))) {
    pending_.fetch_sub(1);
    return false;
  }
  return true;
}

void ShadowRunner::WaitIdle() {
  absl::MutexLock l(&idle_mu_);
  idle_mu_.Await(absl::Condition(
      +[](std::atomic<int64_t>* p) { return p->load() == 0; }, &pending_));
}

void ShadowRunner::Loop() {
  for (;;) {
    std::function<void()> job;
    queue_.pop(job);
    if (!job) return;
    job();
    // Under the mutex so that WaitIdle's condition is re-evaluated.
    absl::MutexLock l(&idle_mu_);
    pending_.fetch_sub(1);
  }
}

}  // namespace verifyd
