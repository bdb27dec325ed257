#pragma once
// Whether the client of a call still waits for it: its deadline and its cancellation, polled
// before each path and, on the CPU engine, between tiles and KV chunks, so that an abandoned call
// stops using the engine.

#include <atomic>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/status/status.h"

namespace verifyd {

class CallContext {
 public:
  using Clock = std::chrono::system_clock;  // gRPC's deadline clock

  CallContext() = default;  // a call nobody abandons
  CallContext(std::function<bool()> cancelled, Clock::time_point deadline)
      : cancelled_(std::move(cancelled)), deadline_(deadline) {}
  CallContext(const CallContext&) = delete;
  CallContext& operator=(const CallContext&) = delete;

  // OK while the client waits; DEADLINE_EXCEEDED past its deadline, CANCELLED once it went away.
  // Once abandoned, stays so. Thread-safe.
  absl::Status Check() const {
    int code = abandoned_.load(std::memory_order_relaxed);
    if (code == 0) {
      if (Clock::now() >= deadline_) {
        code = static_cast<int>(absl::StatusCode::kDeadlineExceeded);
      } else if (cancelled_ && cancelled_()) {
        code = static_cast<int>(absl::StatusCode::kCancelled);
      } else {
        return absl::OkStatus();
      }
      abandoned_.store(code, std::memory_order_relaxed);
    }
    return code == static_cast<int>(absl::StatusCode::kDeadlineExceeded)
               ? absl::DeadlineExceededError("the client's deadline passed; the call was stopped")
               : absl::CancelledError("the client cancelled the call; it was stopped");
  }
  bool Abandoned() const { return !Check().ok(); }

 private:
  std::function<bool()> cancelled_;
  Clock::time_point deadline_ = Clock::time_point::max();
  mutable std::atomic<int> abandoned_{0};  // an absl::StatusCode once abandoned
};

}  // namespace verifyd
