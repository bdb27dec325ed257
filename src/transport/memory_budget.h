#pragma once
// A ceiling on the bytes that requests in flight may hold together. A request is admitted only
// when its size fits next to those already admitted; otherwise it is refused at once, never
// queued. An admission gives its bytes back when it goes out of scope.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace verifyd {

class MemoryBudget {
 public:
  // Bytes held by one admitted request until destroyed.
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) {
      o.budget_ = nullptr;
    }
    Admission& operator=(Admission&& o) noexcept;
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;
    ~Admission() { Release(); }
    int64_t bytes() const { return bytes_; }

   private:
    friend class MemoryBudget;
    Admission(MemoryBudget* b, int64_t bytes) : budget_(b), bytes_(bytes) {}
    void Release();
    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // `limit_bytes` <= 0: no ceiling. `flag` names the setting in refusals.
  MemoryBudget(int64_t limit_bytes, const char* flag) : limit_(limit_bytes), flag_(flag) {}

  // RESOURCE_EXHAUSTED naming the limit when `bytes` does not fit now.
  absl::StatusOr<Admission> Admit(int64_t bytes);
  int64_t in_flight() const;
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  const char* const flag_;
  mutable absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace verifyd
