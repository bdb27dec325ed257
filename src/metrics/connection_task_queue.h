#pragma once
// A cpp-httplib task queue that gives each connection its own thread, up to `max_threads` at
// once (beyond that, connections wait for a thread). A thread idle for a second exits. Unlike
// httplib's fixed pool, idle keep-alive connections cannot hold every thread while a scrape
// waits, and no thread is kept while nobody is connected.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "httplib.h"

namespace verifyd {

class ConnectionTaskQueue : public httplib::TaskQueue {
 public:
  explicit ConnectionTaskQueue(size_t max_threads) : max_threads_(max_threads) {}

  void enqueue(std::function<void()> fn) override {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && running_ < max_threads_) {
      ++running_;
      std::thread([this] { Work(); }).detach();
    } else {
      work_.notify_one();
    }
  }

  // Runs the queued connections to their end, then returns once every thread has exited.
  void shutdown() override {
    std::unique_lock<std::mutex> l(mu_);
    shutdown_ = true;
    work_.notify_all();
    exited_.wait(l, [this] { return running_ == 0; });
  }

 private:
  void Work() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      ++idle_;
      const bool has_job = work_.wait_for(l, std::chrono::seconds(1),
                                          [this] { return !jobs_.empty() || shutdown_; });
      --idle_;
      if (!has_job || jobs_.empty()) break;  // idle for a second, or shutting down
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      l.unlock();
      fn();
      l.lock();
    }
    if (--running_ == 0) exited_.notify_all();
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable work_, exited_;
  std::deque<std::function<void()>> jobs_;
  size_t running_ = 0, idle_ = 0;
  bool shutdown_ = false;
};

}  // namespace verifyd
