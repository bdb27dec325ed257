// CallContext: how an abandoned call is named. The server's deadline falls a little after the
// client's, so the client's cancellation when its deadline passes can arrive first; it must still
// count as DEADLINE_EXCEEDED (EndToEndTest.AnAbandonedCallStopsComputingAndIsCountedAsSuch saw it
// counted as CANCELLED under load).

#include <atomic>
#include <chrono>

#include "gtest/gtest.h"
#include "src/engine/call_context.h"

namespace verifyd {
namespace {

using Clock = CallContext::Clock;

TEST(CallContext, AWaitingClientIsOk) {
  EXPECT_TRUE(CallContext().Check().ok());
  CallContext c([] { return false; }, Clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(c.Check().ok());
  EXPECT_FALSE(c.Abandoned());
}

TEST(CallContext, APassedDeadlineIsDeadlineExceeded) {
  CallContext c([] { return false; }, Clock::now() - std::chrono::milliseconds(1));
  EXPECT_EQ(c.Check().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(CallContext, ACancelFarFromTheDeadlineIsCancelled) {
  CallContext c([] { return true; }, Clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(c.Check().code(), absl::StatusCode::kCancelled);
  CallContext none([] { return true; }, Clock::time_point::max());
  EXPECT_EQ(none.Check().code(), absl::StatusCode::kCancelled);
}

TEST(CallContext, ACancelJustBeforeTheDeadlineIsTheDeadlines) {
  CallContext c([] { return true; }, Clock::now() + CallContext::kDeadlineSkew / 2);
  EXPECT_EQ(c.Check().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(CallContext, TheFirstVerdictStays) {
  std::atomic<bool> cancelled{true};
  CallContext c([&] { return cancelled.load(); }, Clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(c.Check().code(), absl::StatusCode::kCancelled);
  cancelled = false;
  EXPECT_EQ(c.Check().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace verifyd
