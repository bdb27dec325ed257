#include "src/server/shadow_runner.h"

#include <utility>

namespace verifyd {

ShadowRunner::Slot::~Slot() {
  if (runner_ != nullptr) runner_->waiting_.fetch_sub(1);
}

ShadowRunner::ShadowRunner(int threads, int capacity) : capacity_(capacity) {
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
}

ShadowRunner::~ShadowRunner() {
  WaitIdle();
  // An empty job tells a worker to stop.
  for (size_t i = 0; i < workers_.size(); ++i) queue_.push(nullptr);
  for (auto& t : workers_) t.join();
}

std::optional<ShadowRunner::Slot> ShadowRunner::TryReserve() {
  int64_t n = waiting_.load();
  do {
    if (n >= capacity_) return std::nullopt;
  } while (!waiting_.compare_exchange_weak(n, n + 1));
  return Slot(this);
}

void ShadowRunner::Submit(Slot slot, std::function<void()> job) {
  slot.runner_ = nullptr;  // the place passes to the queued job; the worker gives it back
  pending_.fetch_add(1);
  queue_.push(std::move(job));
}

bool ShadowRunner::TrySubmit(std::function<void()> job) {
  std::optional<Slot> slot = TryReserve();
  if (!slot) return false;
  Submit(std::move(*slot), std::move(job));
  return true;
}

void ShadowRunner::WaitIdle() {
  absl::MutexLock l(&idle_mu_);
  idle_mu_.Await(absl::Condition(
      +[](std::atomic<int64_t>* p) { return p->load() == 0; }, &pending_));
}

int64_t ShadowRunner::DropQueued() {
  int64_t dropped = 0;
  std::function<void()> job;
  while (queue_.try_pop(job)) {
    if (!job) {  // a stop marker (the destructor's): put it back for a worker
      queue_.push(nullptr);
      break;
    }
    waiting_.fetch_sub(1);
    ++dropped;
    absl::MutexLock l(&idle_mu_);
    pending_.fetch_sub(1);
  }
  return dropped;
}

void ShadowRunner::Loop() {
  for (;;) {
    std::function<void()> job;
    queue_.pop(job);
    if (!job) return;
    waiting_.fetch_sub(1);
    job();
    // Under the mutex so that WaitIdle's condition is re-evaluated.
    absl::MutexLock l(&idle_mu_);
    pending_.fetch_sub(1);
  }
}

}  // namespace verifyd
