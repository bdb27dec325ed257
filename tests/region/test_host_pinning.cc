// PinHost: the one place where host memory that calls read in place (shm regions, call channels,
// receive buffers) is pinned for the engine. A failure must leave the memory usable (no unpin to
// run) and a success must hand back exactly the engine's unpin.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "src/region/host_pinning.h"

namespace verifyd {
namespace {

TEST(HostPinning, NoPinnerPinsNothing) {
  char buf[64];
  const PinnedHost p = PinHost(nullptr, buf, sizeof buf, "region 'r'");
  EXPECT_FALSE(p.unpin);
  EXPECT_EQ(p.took, absl::ZeroDuration());
}

TEST(HostPinning, ASuccessReturnsTheEnginesUnpinForTheExactRange) {
  std::vector<char> mem(4099);
  char* seen_base = nullptr;
  uint64_t seen_bytes = 0;
  int unpinned = 0;
  const HostPinner pin = [&](char* base, uint64_t bytes) -> absl::StatusOr<std::function<void()>> {
    seen_base = base;
    seen_bytes = bytes;
    return std::function<void()>([&unpinned] { ++unpinned; });
  };
  PinnedHost p = PinHost(pin, mem.data() + 3, 4096, "channel 'c'");
  EXPECT_EQ(seen_base, mem.data() + 3);
  EXPECT_EQ(seen_bytes, 4096u);
  ASSERT_TRUE(p.unpin);
  EXPECT_GE(p.took, absl::ZeroDuration());
  EXPECT_EQ(unpinned, 0);
  p.unpin();
  EXPECT_EQ(unpinned, 1);
}

TEST(HostPinning, AFailureLeavesTheMemoryUnpinned) {
  char buf[64];
  int calls = 0;
  const HostPinner pin = [&](char*, uint64_t) -> absl::StatusOr<std::function<void()>> {
    ++calls;
    return absl::ResourceExhaustedError("cudaHostRegister: out of memory");
  };
  const PinnedHost p = PinHost(pin, buf, sizeof buf, "receive buffer of 1 MiB");
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(p.unpin);
}

TEST(HostPinning, AnEngineWithNothingToPinReturnsNoUnpin) {
  char buf[64];
  const HostPinner pin = [](char*, uint64_t) -> absl::StatusOr<std::function<void()>> {
    return std::function<void()>();
  };
  EXPECT_FALSE(PinHost(pin, buf, sizeof buf, "region 'r'").unpin);
}

}  // namespace
}  // namespace verifyd
