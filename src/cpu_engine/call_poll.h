#pragma once
// How often the CPU paths look at their call's CallContext inside their loops. One draft token of
// a reference head block (up to 128 heads x 128K keys in fp64) or one KV tile of the custom path
// (T x heads rows, up to 128K) can take seconds; the paths count the work they do and check the
// call every kWorkPerCheck multiply-adds, so that an abandoned call stops within about a
// millisecond of work whatever the shape. Check() reads the clock and asks the transport whether
// the client went away; at this spacing its cost does not show.

#include <cstdint>

#include "src/engine/call_context.h"

namespace verifyd {

// One per thread of a path: the count is not shared.
class CallPoll {
 public:
  // About 0.2-1 ms of one core's work, fp32 or fp64.
  static constexpr int64_t kWorkPerCheck = int64_t{1} << 20;

  explicit CallPoll(const CallContext* call) : call_(call) {}  // null: never abandoned
  CallPoll(const CallPoll&) = delete;
  CallPoll& operator=(const CallPoll&) = delete;

  // Adds `work` multiply-adds (the step the caller is about to take) to the count. True once the
  // call is abandoned, seen at the first check after it was: the caller then stops, its outputs
  // incomplete.
  bool Abandoned(int64_t work) {
    if (call_ == nullptr) return false;
    if ((work_ += work) < kWorkPerCheck) return false;
    work_ = 0;
    return call_->Abandoned();
  }

 private:
  const CallContext* call_;
  int64_t work_ = 0;  // since the last check
};

}  // namespace verifyd
