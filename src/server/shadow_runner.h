#pragma once
// Runs comparisons off the response's critical path: a bounded queue and a fixed set of worker
// threads. When the queue is full the job is refused (the caller counts a skip) rather than
// slowing the response.

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tbb/concurrent_queue.h"

namespace verifyd {

class ShadowRunner {
 public:
  ShadowRunner(int threads, int capacity);
  ~ShadowRunner();  // finishes queued jobs, then joins

  // False when the queue is full.
  bool TrySubmit(std::function<void()> job);
  int64_t depth() const { return pending_.load(); }
  // Blocks until every submitted job has finished (tests, shutdown).
  void WaitIdle();

 private:
  void Loop();
  tbb::concurrent_bounded_queue<std::function<void()>> queue_;
  std::atomic<int64_t> pending_{0};
  absl::Mutex idle_mu_;
  std::vector<std::thread> workers_;
};

}  // namespace verifyd
