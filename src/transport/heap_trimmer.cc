#include "src/transport/heap_trimmer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "spdlog/spdlog.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace verifyd {
namespace {

constexpr int64_t kMinAfterBytes = int64_t{64} << 20;

void TrimHeap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// The process's resident bytes (/proc/self/statm), for the log; 0 when unreadable.
int64_t ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long size = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : 0;
}

}  // namespace

int64_t HeapTrimmer::AfterBytesFor(int64_t keep_freed_bytes) {
  return std::max(keep_freed_bytes / 5 * 2, kMinAfterBytes);
}

HeapTrimmer::HeapTrimmer(Options opts, std::function<bool()> idle, std::function<void()> trim)
    : opts_(opts), idle_(std::move(idle)), trim_(trim ? std::move(trim) : TrimHeap) {
  if (opts_.after_bytes > 0) thread_ = std::thread([this] { Loop(); });
}

HeapTrimmer::~HeapTrimmer() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void HeapTrimmer::Idle(int64_t peak_bytes) {
  if (opts_.after_bytes <= 0) return;
  absl::MutexLock l(&mu_);
  peak_ = std::max(peak_, peak_bytes);
  if (peak_ >= opts_.after_bytes && !pending_) {
    pending_ = true;
    pending_since_ = absl::Now();
  }
}

int64_t HeapTrimmer::trims() const {
  absl::MutexLock l(&mu_);
  return trims_;
}

bool HeapTrimmer::WakeLocked() const { return pending_ || stop_; }

void HeapTrimmer::Loop() {
  absl::MutexLock l(&mu_);
  while (true) {
    mu_.Await(absl::Condition(this, &HeapTrimmer::WakeLocked));
    if (stop_) return;
    // What the burst's calls free after they end is freed within `settle`; and at most once per
    // interval: a burst soon after a trim waits for the interval to pass.
    mu_.AwaitWithDeadline(absl::Condition(&stop_),
                          std::max(pending_since_ + opts_.settle, last_trim_ + opts_.min_interval));
    if (stop_) return;
    pending_ = false;
    const int64_t peak = std::exchange(peak_, 0);
    mu_.Unlock();
    const bool idle = idle_();
    int64_t before = 0, after = 0;
    absl::Duration took;
    if (idle) {
      before = ResidentBytes();
      const absl::Time t0 = absl::Now();
      trim_();
      took = absl::Now() - t0;
      after = ResidentBytes();
    }
    mu_.Lock();
    if (!idle) {
      // Calls came back in the meantime: trim when they are done.
      peak_ = std::max(peak_, peak);
      continue;
    }
    last_trim_ = absl::Now();
    ++trims_;
    spdlog::debug(
        "returned freed heap memory after a burst of {} MiB in flight: resident {} -> {} "
        "MiB in {:.1f} ms",
        peak >> 20, before >> 20, after >> 20, absl::ToDoubleMilliseconds(took));
  }
}

}  // namespace verifyd
