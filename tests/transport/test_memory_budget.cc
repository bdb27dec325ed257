// The in-flight memory budget's own accounting: what fits is admitted and given back when
// released; what does not is refused, naming the limit. The heap trimmer it tells when nothing is
// in flight: a trim after a burst past its threshold, at most once per interval, never while
// calls are in flight.

#include <atomic>
#include <chrono>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "src/transport/heap_trimmer.h"
#include "src/transport/memory_budget.h"

namespace verifyd {
namespace {

TEST(MemoryBudget, AdmitsWhatFitsAndTakesItBackWhenReleased) {
  MemoryBudget b(100, "--limit");
  auto a = b.Admit(60);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(b.in_flight(), 60);
  auto refused = b.Admit(41);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("(--limit)"), std::string::npos);
  {
    auto c = b.Admit(40);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(b.in_flight(), 100);
    MemoryBudget::Admission moved = std::move(*c);
    EXPECT_EQ(b.in_flight(), 100);
  }
  EXPECT_EQ(b.in_flight(), 60);
  *a = MemoryBudget::Admission();
  EXPECT_EQ(b.in_flight(), 0);
  auto too_big = b.Admit(101);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("exceeds the memory budget"), std::string::npos);
  MemoryBudget unlimited(0, "--limit");
  EXPECT_TRUE(unlimited.Admit(int64_t{1} << 50).ok());
}

TEST(MemoryBudget, OnePeerHoldsAtMostItsShare) {
  MemoryBudget b(100, "--limit", nullptr, 0.4);
  EXPECT_EQ(b.peer_limit(), 40);
  auto a = b.Admit(30, "uid 7");
  ASSERT_TRUE(a.ok());
  auto refused = b.Admit(11, "uid 7");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("uid 7's share"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("--max_inflight_peer_share"), std::string::npos);
  auto never = b.Admit(41, "uid 8");
  ASSERT_FALSE(never.ok());
  EXPECT_NE(never.status().message().find("exceeds one peer's share"), std::string::npos)
      << never.status();
  // Others fit beside it, up to the ceiling; the peer's own room comes back with its bytes.
  auto c = b.Admit(40, "uid 8");
  auto d = b.Admit(30, "tcp");
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_FALSE(b.Admit(1, "uid 9").ok());  // the ceiling, 100
  a->ShrinkTo(20);
  EXPECT_TRUE(b.Admit(10, "uid 7").ok());
  *a = MemoryBudget::Admission();
  EXPECT_EQ(b.in_flight(), 70);
  EXPECT_TRUE(b.Admit(30, "uid 7").ok());
  // Without a peer, only the ceiling counts.
  *c = MemoryBudget::Admission();
  EXPECT_TRUE(b.Admit(40).ok());
}

TEST(MemoryBudget, AShrunkAdmissionGivesTheRestBack) {
  MemoryBudget b(100, "--limit");
  auto a = b.Admit(80);
  ASSERT_TRUE(a.ok());
  a->ShrinkTo(30);
  EXPECT_EQ(a->bytes(), 30);
  EXPECT_EQ(b.in_flight(), 30);
  EXPECT_TRUE(b.Admit(70).ok());
  a->ShrinkTo(50);  // never grows
  EXPECT_EQ(b.in_flight(), 30);
  *a = MemoryBudget::Admission();
  EXPECT_EQ(b.in_flight(), 0);
}

TEST(MemoryBudget, TheObserverLearnsThePeakEachTimeNothingIsLeftInFlight) {
  std::vector<int64_t> peaks;
  MemoryBudget b(0, "--limit", [&peaks](int64_t peak) { peaks.push_back(peak); });
  std::mt19937 rng(7);
  for (int burst = 0; burst < 5; ++burst) {
    std::vector<MemoryBudget::Admission> held;
    int64_t sum = 0, peak = 0;
    for (int i = 0; i < 1 + static_cast<int>(rng() % 6); ++i) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 1000);
      held.push_back(*b.Admit(n));
      sum += n;
      peak = std::max(peak, sum);
      if (held.size() > 1 && rng() % 3 == 0) {  // one call ends while others go on
        sum -= held.front().bytes();
        held.erase(held.begin());
      }
    }
    EXPECT_EQ(peaks.size(), static_cast<size_t>(burst));
    held.clear();
    ASSERT_EQ(peaks.size(), static_cast<size_t>(burst + 1));
    EXPECT_EQ(peaks.back(), peak) << "burst " << burst;
  }
}

// Waits (at most 5 s) until `trims` reaches `n`.
bool WaitForTrims(const HeapTrimmer& t, int64_t n) {
  for (int i = 0; i < 500 && t.trims() < n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return t.trims() >= n;
}

TEST(HeapTrimmer, TrimsAfterABurstPastItsThresholdAndNotAfterSmallerOnes) {
  std::atomic<int> trimmed{0};
  std::optional<HeapTrimmer> trimmer;
  MemoryBudget b(0, "--limit", [&trimmer](int64_t peak) { trimmer->Idle(peak); });
  trimmer.emplace(
      HeapTrimmer::Options{100, absl::ZeroDuration(), absl::ZeroDuration()},
      [&b] { return b.in_flight() == 0; }, [&trimmed] { ++trimmed; });
  // A steady load below the threshold, one call at a time: never.
  for (int i = 0; i < 50; ++i) {
    auto a = b.Admit(99);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trimmer->trims(), 0);
  {
    auto a = b.Admit(60);
    auto c = b.Admit(40);  // 100 in flight together
  }
  ASSERT_TRUE(WaitForTrims(*trimmer, 1));
  EXPECT_EQ(trimmed.load(), 1);
  // The burst was trimmed after: smaller calls do not trim again.
  for (int i = 0; i < 20; ++i) {
    auto a = b.Admit(50);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trimmer->trims(), 1);
  trimmer.reset();
}

TEST(HeapTrimmer, AtMostOncePerInterval) {
  std::atomic<int> trimmed{0};
  std::optional<HeapTrimmer> trimmer;
  MemoryBudget b(0, "--limit", [&trimmer](int64_t peak) { trimmer->Idle(peak); });
  trimmer.emplace(
      HeapTrimmer::Options{100, absl::Milliseconds(500), absl::ZeroDuration()},
      [&b] { return b.in_flight() == 0; }, [&trimmed] { ++trimmed; });
  const auto t0 = std::chrono::steady_clock::now();
  { auto a = b.Admit(100); }
  ASSERT_TRUE(WaitForTrims(*trimmer, 1));
  for (int i = 0; i < 10; ++i) {
    auto a = b.Admit(200);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(trimmer->trims(), 1) << "a second trim within the interval";
  ASSERT_TRUE(WaitForTrims(*trimmer, 2));  // the burst's trim, once the interval passed
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_EQ(trimmer->trims(), 2);
  trimmer.reset();
}

TEST(HeapTrimmer, NeverWhileCallsAreInFlight) {
  std::atomic<int> trimmed{0};
  std::optional<HeapTrimmer> trimmer;
  MemoryBudget b(0, "--limit", [&trimmer](int64_t peak) { trimmer->Idle(peak); });
  trimmer.emplace(
      HeapTrimmer::Options{100, absl::Milliseconds(300), absl::ZeroDuration()},
      [&b] { return b.in_flight() == 0; }, [&trimmed] { ++trimmed; });
  { auto a = b.Admit(100); }
  ASSERT_TRUE(WaitForTrims(*trimmer, 1));
  { auto a = b.Admit(100); }  // its trim waits for the interval...
  auto busy = b.Admit(1);     // ...during which calls came back
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(trimmer->trims(), 1);
  busy = MemoryBudget::Admission();  // the small call's end ends the burst
  ASSERT_TRUE(WaitForTrims(*trimmer, 2));
  EXPECT_EQ(trimmed.load(), 2);
  trimmer.reset();
}

TEST(HeapTrimmer, WaitsForTheBurstToSettle) {
  std::atomic<int> trimmed{0};
  std::optional<HeapTrimmer> trimmer;
  MemoryBudget b(0, "--limit", [&trimmer](int64_t peak) { trimmer->Idle(peak); });
  trimmer.emplace(
      HeapTrimmer::Options{100, absl::ZeroDuration(), absl::Milliseconds(400)},
      [&b] { return b.in_flight() == 0; }, [&trimmed] { ++trimmed; });
  const auto t0 = std::chrono::steady_clock::now();
  { auto a = b.Admit(100); }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(trimmer->trims(), 0);
  ASSERT_TRUE(WaitForTrims(*trimmer, 1));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(400));
  trimmer.reset();
}

TEST(HeapTrimmer, ThresholdFollowsWhatGlibcIsMeantToKeep) {
  EXPECT_EQ(HeapTrimmer::AfterBytesFor(int64_t{2047} << 20), (int64_t{2047} << 20) / 5 * 2);
  EXPECT_EQ(HeapTrimmer::AfterBytesFor(0), int64_t{64} << 20);
  EXPECT_EQ(HeapTrimmer::AfterBytesFor(int64_t{100} << 20), int64_t{64} << 20);
}

}  // namespace
}  // namespace verifyd
