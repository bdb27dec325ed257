#pragma once
// Runs comparisons off the response's critical path: a bounded queue and a fixed set of worker
// threads. When the queue is full the job is refused (the caller counts a skip or serves
// differently) rather than slowing the response. A place in the queue can be reserved before the
// job exists, so that a call knows whether its comparison will run before it picks what to serve.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tbb/concurrent_queue.h"

namespace verifyd {

class ShadowRunner {
 public:
  // One reserved place in the queue; given back when dropped without Submit().
  class Slot {
   public:
    Slot(Slot&& other) noexcept : runner_(other.runner_) { other.runner_ = nullptr; }
    Slot& operator=(Slot&&) = delete;
    ~Slot();

   private:
    friend class ShadowRunner;
    explicit Slot(ShadowRunner* runner) : runner_(runner) {}
    ShadowRunner* runner_;
  };

  ShadowRunner(int threads, int capacity);
  ~ShadowRunner();  // finishes queued jobs (DropQueued first to skip them), then joins

  // A place in the queue, or nullopt when `capacity` jobs already wait (reserved or queued).
  std::optional<Slot> TryReserve();
  // Queues `job` in the reserved place.
  void Submit(Slot slot, std::function<void()> job);
  // TryReserve() + Submit(); false when the queue is full.
  bool TrySubmit(std::function<void()> job);
  // Jobs waiting to start (reserved or queued; not the running ones): never above capacity.
  int64_t depth() const { return waiting_.load(); }
  int capacity() const { return capacity_; }
  // Blocks until every submitted job has finished (tests, shutdown).
  void WaitIdle();
  // Removes the jobs still waiting to start, unrun, and returns how many there were; the running
  // ones go on. At shutdown: a full queue of comparisons would otherwise hold the exit for
  // seconds.
  int64_t DropQueued();

 private:
  void Loop();
  const int capacity_;
  tbb::concurrent_bounded_queue<std::function<void()>> queue_;  // bounded by waiting_
  std::atomic<int64_t> waiting_{0};  // reserved or queued, not yet started
  std::atomic<int64_t> pending_{0};  // submitted, not yet finished
  absl::Mutex idle_mu_;
  std::vector<std::thread> workers_;
};

}  // namespace verifyd
