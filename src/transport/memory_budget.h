#pragma once
// A ceiling on the bytes that requests in flight may hold together. A request is admitted only
// when its size fits next to those already admitted; otherwise it is refused at once, never
// queued. An admission gives its bytes back when it goes out of scope. Whenever the bytes in
// flight drop back to zero, an observer learns the most they reached since they last did (the
// heap trimmer, heap_trimmer.h, returns freed memory to the system after a large burst).
// With a per-peer share, no one peer (StreamLimiter's ShareKey) may hold more than that part of
// the ceiling, so that one peer's declared sizes cannot refuse every other caller.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace verifyd {

class MemoryBudget {
 public:
  // Bytes held by one admitted request until destroyed.
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& o) noexcept
        : budget_(o.budget_), bytes_(o.bytes_), peer_(std::move(o.peer_)) {
      o.budget_ = nullptr;
    }
    Admission& operator=(Admission&& o) noexcept;
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;
    ~Admission() { Release(); }
    int64_t bytes() const { return bytes_; }
    // Gives back all but `bytes` of the admission (a request found smaller than declared);
    // nothing when it holds no more than that.
    void ShrinkTo(int64_t bytes);

   private:
    friend class MemoryBudget;
    Admission(MemoryBudget* b, int64_t bytes, std::string peer)
        : budget_(b), bytes_(bytes), peer_(std::move(peer)) {}
    void Release();
    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
    std::string peer_;
  };

  // Called, without the budget's lock, each time the bytes in flight drop back to zero, with the
  // most they reached since they last did.
  using IdleObserver = std::function<void(int64_t peak_bytes)>;

  // `limit_bytes` <= 0: no ceiling. `flag` names the setting in refusals. `peer_share` in (0, 1]:
  // the part of the ceiling one peer may hold (1: no share of its own).
  MemoryBudget(int64_t limit_bytes, const char* flag, IdleObserver on_idle = nullptr,
               double peer_share = 1)
      : limit_(limit_bytes),
        peer_limit_(peer_share < 1
                        ? static_cast<int64_t>(static_cast<double>(limit_bytes) * peer_share)
                        : limit_bytes),
        flag_(flag),
        on_idle_(std::move(on_idle)) {}

  // RESOURCE_EXHAUSTED naming the limit when `bytes` does not fit now, for `peer` (empty: counted
  // against the ceiling only).
  absl::StatusOr<Admission> Admit(int64_t bytes, const std::string& peer = "");
  int64_t peer_limit() const { return peer_limit_; }
  int64_t in_flight() const;
  int64_t limit() const { return limit_; }

 private:
  // Takes `bytes` out of the bytes in flight; tells on_idle_ when that leaves none.
  void GiveBack(int64_t bytes, const std::string& peer);

  const int64_t limit_;
  const int64_t peer_limit_;
  const char* const flag_;
  const IdleObserver on_idle_;
  mutable absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;  // the most in flight since they were last zero
  std::map<std::string, int64_t> by_peer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
