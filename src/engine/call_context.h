#pragma once
// Whether the client of a call still waits for it: its deadline and its cancellation, polled
// before each path and, on the CPU engine, between tiles and KV chunks, so that an abandoned call
// stops using the engine. And who the client is (the regions it may name), and how work that
// outlives the call holds its share of the memory budget (HoldBytes).

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/common/peer.h"

namespace verifyd {

class CallContext {
 public:
  using Clock = std::chrono::system_clock;  // gRPC's deadline clock

  // A call nobody abandons, from `peer` (by default nobody verified: it may name no region).
  explicit CallContext(Peer peer = Peer()) : peer_(std::move(peer)) {}
  CallContext(std::function<bool()> cancelled, Clock::time_point deadline, Peer peer = Peer())
      : cancelled_(std::move(cancelled)), deadline_(deadline), peer_(std::move(peer)) {}
  CallContext(const CallContext&) = delete;
  CallContext& operator=(const CallContext&) = delete;

  // The deadline gRPC gives the server is the client's remaining time counted from when the
  // call's headers arrived, so it falls a little after the client's own; when the client's
  // passes, its cancellation can arrive first. A cancellation seen this close to the deadline is
  // the deadline's.
  static constexpr std::chrono::milliseconds kDeadlineSkew{100};

  // OK while the client waits; DEADLINE_EXCEEDED past its deadline (or cancelled within
  // kDeadlineSkew of it), CANCELLED once it went away. Once abandoned, stays so. Thread-safe.
  absl::Status Check() const {
    int code = abandoned_.load(std::memory_order_relaxed);
    if (code == 0) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline_) {
        code = static_cast<int>(absl::StatusCode::kDeadlineExceeded);
      } else if (cancelled_ && cancelled_()) {
        code =
            static_cast<int>(deadline_ - now <= kDeadlineSkew ? absl::StatusCode::kDeadlineExceeded
                                                              : absl::StatusCode::kCancelled);
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
  const Peer& peer() const { return peer_; }

  // Admits `bytes` more to the memory budget (--max_inflight_mb) for the caller, held until the
  // returned handle is dropped: what the call's work keeps after its response (a copy of its
  // inputs for a comparison still queued) is counted like its request was.
  // RESOURCE_EXHAUSTED when it does not fit now; an empty handle where no budget is kept.
  using Hold = std::function<absl::StatusOr<std::shared_ptr<void>>(int64_t bytes)>;
  void set_hold(Hold hold) { hold_ = std::move(hold); }
  absl::StatusOr<std::shared_ptr<void>> HoldBytes(int64_t bytes) const {
    if (!hold_ || bytes <= 0) return std::shared_ptr<void>();
    return hold_(bytes);
  }

 private:
  Hold hold_;
  std::function<bool()> cancelled_;
  Clock::time_point deadline_ = Clock::time_point::max();
  Peer peer_;
  mutable std::atomic<int> abandoned_{0};  // an absl::StatusCode once abandoned
};

}  // namespace verifyd
