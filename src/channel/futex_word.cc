#include "src/channel/futex_word.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

#include "absl/time/clock.h"

namespace verifyd::channel {
namespace {

// Shared, not FUTEX_PRIVATE_FLAG: the other side is another process.
long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  Futex(word, FUTEX_WAIT, expected, &ts);  // EAGAIN (changed), EINTR, ETIMEDOUT: all return
}

void FutexWake(std::atomic<uint32_t>* word) { Futex(word, FUTEX_WAKE, INT_MAX, nullptr); }

uint32_t AwaitChange(std::atomic<uint32_t>* word, uint32_t old, absl::Duration spin,
                     absl::Duration nap, const std::function<bool()>& give_up,
                     absl::Time deadline) {
  const absl::Time spin_end = absl::Now() + spin;
  for (int i = 0;; ++i) {
    const uint32_t v = word->load(std::memory_order_acquire);
    if (v != old) return v;
    if ((i & 63) == 63 && absl::Now() >= spin_end) break;
    CpuRelax();
  }
  for (;;) {
    const uint32_t v = word->load(std::memory_order_acquire);
    if (v != old) return v;
    const absl::Time now = absl::Now();
    if (now >= deadline || (give_up && give_up())) return old;
    FutexWait(word, old, std::min(nap, deadline - now));
  }
}

absl::Duration AdaptiveSpin(absl::Duration last_gap, absl::Duration floor, absl::Duration cap) {
  floor = std::min(floor, cap);
  if (last_gap > cap) return floor;
  return std::clamp(2 * last_gap, floor, cap);
}

}  // namespace verifyd::channel
