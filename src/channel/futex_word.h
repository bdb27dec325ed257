#pragma once
// Waiting on a 32-bit word that another process changes (a call channel's sequence words):
// a short spin, then the kernel's futex, which shared mappings of one object share.

#include <atomic>
#include <cstdint>
#include <functional>

#include "absl/time/time.h"

namespace verifyd::channel {

// Sleeps while *word == expected, for at most `timeout`; may return early (a wake, a signal).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// Wakes every thread in any process waiting on `word`.
void FutexWake(std::atomic<uint32_t>* word);

// Waits until *word != old: spins for `spin` first (a change that comes within it costs no
// system call on either side), then sleeps in naps of at most `nap`, asking `give_up` after
// each. Returns the new value, or `old` when it gave up or `deadline` passed.
uint32_t AwaitChange(std::atomic<uint32_t>* word, uint32_t old, absl::Duration spin,
                     absl::Duration nap, const std::function<bool()>& give_up,
                     absl::Time deadline = absl::InfiniteFuture());

// How long a waiter spins for the next change after the last one came `last_gap` after the one
// before (from the answer to the next call): twice that gap, within [floor, cap], when the gap
// was within `cap` (the next change is likely to come as soon, and spinning saves the wake-up);
// only `floor` after a longer gap (a caller that slow would rarely be caught). floor <= cap.
absl::Duration AdaptiveSpin(absl::Duration last_gap, absl::Duration floor, absl::Duration cap);

}  // namespace verifyd::channel
