// The shadow runner's queue: its depth counts waiting jobs only and never exceeds the capacity;
// reserved places count against it and come back when dropped; queued jobs can be dropped unrun
// (shutdown) while the running one finishes.

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "src/server/shadow_runner.h"

namespace verifyd {
namespace {

// One worker held busy by a job that waits for `release`.
struct BusyRunner {
  explicit BusyRunner(int capacity) : runner(1, capacity) {
    EXPECT_TRUE(runner.TrySubmit([this] {
      started.Notify();
      release.WaitForNotification();
    }));
    started.WaitForNotification();
  }
  ~BusyRunner() {
    if (!release.HasBeenNotified()) release.Notify();
    runner.WaitIdle();
  }
  absl::Notification started, release;
  ShadowRunner runner;
};

TEST(ShadowRunner, DepthCountsWaitingJobsAndNeverExceedsTheCapacity) {
  BusyRunner busy(2);
  ShadowRunner& r = busy.runner;
  EXPECT_EQ(r.depth(), 0);  // the running job is not waiting
  std::atomic<int> ran{0};
  EXPECT_TRUE(r.TrySubmit([&] { ++ran; }));
  EXPECT_TRUE(r.TrySubmit([&] { ++ran; }));
  EXPECT_EQ(r.depth(), 2);
  EXPECT_FALSE(r.TrySubmit([&] { ++ran; }));
  EXPECT_EQ(r.depth(), 2);
  busy.release.Notify();
  r.WaitIdle();
  EXPECT_EQ(ran.load(), 2);
  EXPECT_EQ(r.depth(), 0);
}

TEST(ShadowRunner, AReservedPlaceCountsAndComesBackWhenDropped) {
  BusyRunner busy(1);
  ShadowRunner& r = busy.runner;
  {
    std::optional<ShadowRunner::Slot> slot = r.TryReserve();
    ASSERT_TRUE(slot.has_value());
    EXPECT_EQ(r.depth(), 1);
    EXPECT_FALSE(r.TryReserve().has_value());
    EXPECT_FALSE(r.TrySubmit([] {}));
  }
  EXPECT_EQ(r.depth(), 0);
  std::optional<ShadowRunner::Slot> slot = r.TryReserve();
  ASSERT_TRUE(slot.has_value());
  std::atomic<bool> ran{false};
  r.Submit(std::move(*slot), [&] { ran = true; });
  slot.reset();  // the moved-from place gives nothing back
  EXPECT_EQ(r.depth(), 1);
  busy.release.Notify();
  r.WaitIdle();
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(r.depth(), 0);
}

TEST(ShadowRunner, DroppedJobsNeverRunAndTheRunningOneFinishes) {
  BusyRunner busy(4);
  ShadowRunner& r = busy.runner;
  std::atomic<int> ran{0};
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(r.TrySubmit([&] { ++ran; }));
  EXPECT_EQ(r.depth(), 3);
  EXPECT_EQ(r.DropQueued(), 3);
  EXPECT_EQ(r.depth(), 0);
  EXPECT_EQ(r.DropQueued(), 0);
  busy.release.Notify();
  r.WaitIdle();  // returns once the running job is done: the dropped ones are not pending
  EXPECT_EQ(ran.load(), 0);
  EXPECT_TRUE(r.TrySubmit([&] { ++ran; }));  // the runner still serves
  r.WaitIdle();
  EXPECT_EQ(ran.load(), 1);
}

}  // namespace
}  // namespace verifyd
