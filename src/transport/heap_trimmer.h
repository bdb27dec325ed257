#pragma once
// Gives the memory the heap holds freed back to the system after a large burst of calls.
//
// verifyd serves bundles from the heap and keeps what it freed for later calls (KeepFreedMemory
// in src/common/malloc_arenas.h, --keep_freed_mb): glibc returns free memory only from the top
// of the heap, and only beyond --keep_freed_mb. A freed bundle below a block still in use (a new
// connection's, another call's) stays resident whatever its size, so after a burst of large
// calls the process went on holding about its peak. When the calls in flight drop back to none
// (MemoryBudget's idle observer) after they held at least `after_bytes` together since the last
// trim, the trimmer waits `settle` for what the calls free after they end (their shadow
// comparisons' inputs, the responses) and, if no call is in flight then, has glibc return every
// free page (malloc_trim); else it does so the next time none is. It runs on its own thread, at
// most once per `min_interval`. A steady load of smaller calls, which reuses those pages, never
// pays for it.

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace verifyd {

class HeapTrimmer {
 public:
  struct Options {
    int64_t after_bytes = 0;  // <= 0: never trims (and starts no thread)
    absl::Duration min_interval = absl::Seconds(10);
    absl::Duration settle = absl::Seconds(1);
  };

  // `idle`: whether no call is in flight now, asked just before trimming (a burst that started
  // again waits for its own end). `trim`: returns the freed memory; null: malloc_trim(0) where
  // the C library is glibc, else nothing.
  HeapTrimmer(Options opts, std::function<bool()> idle, std::function<void()> trim = nullptr);
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // The calls in flight dropped back to none, having held at most `peak_bytes` together.
  void Idle(int64_t peak_bytes);
  int64_t trims() const;

  // `after_bytes` for --keep_freed_mb's bytes: a call leaves about 2.6 times its message freed
  // in the heap (docs/operations.md, Tests: Memory), so a burst whose messages held 2/5 of
  // --keep_freed_mb together leaves about what glibc is meant to keep, or more; at least 64 MiB,
  // below which a trim is not worth its cost.
  static int64_t AfterBytesFor(int64_t keep_freed_bytes);

 private:
  void Loop();
  bool WakeLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Options opts_;
  const std::function<bool()> idle_;
  const std::function<void()> trim_;
  mutable absl::Mutex mu_;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;  // the largest burst since the last trim
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time pending_since_ ABSL_GUARDED_BY(mu_);  // the end of the burst to trim after
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_trim_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // last: it uses the members above
};

}  // namespace verifyd
