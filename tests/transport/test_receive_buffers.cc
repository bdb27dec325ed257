// gRPC request messages are received into pooled host buffers and parsed there in place: the
// pool's accounting, pinning and limits.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "src/transport/receive_buffers.h"
#include "tests/transport/sliced_message.h"

namespace verifyd {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

using testing::Sliced;

std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Pins by counting (the CPU build has no device to pin for); the returned function unpins.
struct CountingPinner {
  std::atomic<int> pins{0}, unpins{0};
  bool fail = false;
  RegionRegistry::HostPinner fn() {
    return [this](char*, uint64_t) -> absl::StatusOr<std::function<void()>> {
      if (fail) return absl::ResourceExhaustedError("cudaHostRegister: out of memory");
      ++pins;
      return std::function<void()>([this] { ++unpins; });
    };
  }
};

TEST(ReceiveBuffers, CapacityIsThePowerOfTwoAtOrAboveTheMessageFromOneMiB) {
  EXPECT_EQ(ReceiveBuffers::CapacityFor(0), kMiB);
  EXPECT_EQ(ReceiveBuffers::CapacityFor(1), kMiB);
  EXPECT_EQ(ReceiveBuffers::CapacityFor(kMiB), kMiB);
  EXPECT_EQ(ReceiveBuffers::CapacityFor(kMiB + 1), 2 * kMiB);
  EXPECT_EQ(ReceiveBuffers::CapacityFor(20'000'000), 32 * kMiB);
}

TEST(ReceiveBuffers, AMessageOfManySlicesIsReceivedWholeAndItsWireBytesFreed) {
  std::mt19937 rng(7);
  ReceiveBuffers pool(64 * kMiB, nullptr);
  for (size_t size : {size_t{0}, size_t{1}, size_t{4093}, size_t{kMiB}, size_t{3 * kMiB + 17}}) {
    const std::string text = RandomBytes(size, rng);
    grpc::ByteBuffer in = Sliced(text, 1 + static_cast<int>(rng() % 40), rng);
    absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->bytes(), text) << "size " << size;
    EXPECT_EQ(in.Length(), 0u);
  }
}

// Resident bytes of this process (/proc/self/statm).
int64_t Resident() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  const int got = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return got == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : -1;
}

// A slice whose bytes are mapped for it alone, and which unmaps them when gRPC lets it go,
// noting how far resident memory stood above `base` at that moment.
struct MappedSlices {
  int64_t base = 0;
  int64_t most_above = 0;
  int freed = 0;
  struct One {
    MappedSlices* all;
    void* p;
    size_t n;
  };
  std::vector<One*> ones;
  grpc::Slice Make(size_t n, unsigned char fill) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return grpc::Slice();
    std::memset(p, fill, n);  // resident, as a received slice is
    One* one = new One{this, p, n};
    ones.push_back(one);
    return grpc::Slice(p, n, &MappedSlices::Destroy, one);
  }
  static void Destroy(void* user) {
    One* one = static_cast<One*>(user);
    one->all->most_above = std::max(one->all->most_above, Resident() - one->all->base);
    munmap(one->p, one->n);
    one->all->freed += 1;
  }
  ~MappedSlices() {
    for (One* o : ones) delete o;
  }
};

// A message is held about once while it is received, not twice: each slice's wire bytes are
// let go as soon as they are copied, so resident memory never stands near the message's size
// above where it started (slices, then the buffer filling). Before, every slice lived until the
// whole copy was done: the process held the message twice.
TEST(ReceiveBuffers, EachSlicesWireBytesGoAsSoonAsTheyAreCopied) {
  constexpr size_t kSlice = 4 * kMiB;
  constexpr int kSlices = 48;  // 192 MiB
  ReceiveBuffers pool(0, nullptr);
  MappedSlices mapped;
  {
    std::vector<grpc::Slice> slices;
    for (int i = 0; i < kSlices; ++i) {
      slices.push_back(mapped.Make(kSlice, static_cast<unsigned char>(i)));
      ASSERT_EQ(slices.back().size(), kSlice);
    }
    grpc::ByteBuffer in(slices.data(), slices.size());
    slices.clear();
    mapped.base = Resident();
    ASSERT_GT(mapped.base, static_cast<int64_t>(kSlice) * kSlices);
    absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->bytes().size(), kSlice * kSlices);
    for (int i = 0; i < kSlices; ++i) {
      ASSERT_EQ(static_cast<unsigned char>(m->bytes()[i * kSlice]), static_cast<unsigned char>(i));
      ASSERT_EQ(static_cast<unsigned char>(m->bytes()[(i + 1) * kSlice - 1]),
                static_cast<unsigned char>(i));
    }
  }
  EXPECT_EQ(mapped.freed, kSlices);
  // Allowed: a slice or two copied ahead of its release, the allocator's own noise and, under
  // AddressSanitizer, its shadow of the buffer (an eighth of it): a quarter of the message.
  // Holding it twice puts the whole message above.
  EXPECT_LT(mapped.most_above, static_cast<int64_t>(kSlice * kSlices / 4))
      << "resident memory stood " << (mapped.most_above >> 20) << " MiB above the slices' "
      << ((kSlice * kSlices) >> 20) << " MiB while the message was received";
}

TEST(ReceiveBuffers, ABufferIsPinnedOnceAndReusedByLaterMessagesOfItsSize) {
  std::mt19937 rng(11);
  CountingPinner pinner;
  {
    ReceiveBuffers pool(64 * kMiB, pinner.fn());
    for (int i = 0; i < 20; ++i) {
      const std::string text = RandomBytes(kMiB + 1 + rng() % kMiB, rng);  // the 2 MiB class
      grpc::ByteBuffer in = Sliced(text, 5, rng);
      absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_EQ(m->bytes(), text);
      const ReceiveBuffers::Stats s = pool.stats();
      EXPECT_EQ(s.buffers, 1);
      EXPECT_EQ(s.kept, 0);  // the one buffer is in use
      EXPECT_EQ(s.pinned_bytes, 2 * kMiB);
    }
    EXPECT_EQ(pinner.pins.load(), 1);
    EXPECT_EQ(pool.stats().kept_bytes, 2 * kMiB);
    // Another size class gets a buffer of its own.
    grpc::ByteBuffer in = Sliced(RandomBytes(5 * kMiB, rng), 3, rng);
    ASSERT_TRUE(pool.Receive(in).ok());
    EXPECT_EQ(pinner.pins.load(), 2);
    EXPECT_EQ(pool.stats().bytes, 10 * kMiB);
    EXPECT_EQ(pinner.unpins.load(), 0);
  }
  EXPECT_EQ(pinner.unpins.load(), 2);  // the pool unpins what it kept
}

TEST(ReceiveBuffers, BuffersBeyondTheKeepLimitAreUnpinnedAndFreed) {
  std::mt19937 rng(13);
  CountingPinner pinner;
  std::vector<ReceiveBuffers::Stats> seen;
  ReceiveBuffers pool(3 * kMiB, pinner.fn());
  pool.SetObserver([&seen](const ReceiveBuffers::Stats& s) { seen.push_back(s); });
  {
    grpc::ByteBuffer a = Sliced(RandomBytes(2 * kMiB, rng), 2, rng);
    grpc::ByteBuffer b = Sliced(RandomBytes(2 * kMiB - 5, rng), 2, rng);
    absl::StatusOr<ReceiveBuffers::Message> ma = pool.Receive(a), mb = pool.Receive(b);
    ASSERT_TRUE(ma.ok() && mb.ok());
    EXPECT_EQ(pool.stats().buffers, 2);  // two calls in flight hold one each
    EXPECT_EQ(pinner.pins.load(), 2);
  }
  const ReceiveBuffers::Stats s = pool.stats();
  EXPECT_EQ(s.buffers, 1);
  EXPECT_EQ(s.kept, 1);
  EXPECT_EQ(s.kept_bytes, 2 * kMiB);
  EXPECT_EQ(s.pinned_bytes, 2 * kMiB);
  EXPECT_EQ(pinner.unpins.load(), 1);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().bytes, 2 * kMiB);
  EXPECT_EQ(seen.back().pinned_bytes, 2 * kMiB);
}

TEST(ReceiveBuffers, NothingIsPinnedWhenNothingIsKept) {
  std::mt19937 rng(17);
  CountingPinner pinner;
  ReceiveBuffers pool(0, pinner.fn());
  for (int i = 0; i < 3; ++i) {
    const std::string text = RandomBytes(kMiB + 3, rng);
    grpc::ByteBuffer in = Sliced(text, 4, rng);
    absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->bytes(), text);
  }
  EXPECT_EQ(pinner.pins.load(), 0);
  EXPECT_EQ(pool.stats().buffers, 0);
}

TEST(ReceiveBuffers, ABufferLargerThanThePoolKeepsIsNotPinned) {
  std::mt19937 rng(31);
  CountingPinner pinner;
  ReceiveBuffers pool(3 * kMiB, pinner.fn());
  for (int i = 0; i < 3; ++i) {
    const std::string text = RandomBytes(4 * kMiB + 1, rng);  // the 8 MiB class
    grpc::ByteBuffer in = Sliced(text, 6, rng);
    absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->bytes(), text);
    EXPECT_EQ(pool.stats().pinned_bytes, 0u);
  }
  EXPECT_EQ(pinner.pins.load(), 0);
  EXPECT_EQ(pool.stats().buffers, 0);
}

TEST(ReceiveBuffers, AFailedPinLeavesTheMessageWholeAndTheBufferUnpinned) {
  std::mt19937 rng(19);
  CountingPinner pinner;
  pinner.fail = true;
  ReceiveBuffers pool(64 * kMiB, pinner.fn());
  const std::string text = RandomBytes(kMiB / 2, rng);
  grpc::ByteBuffer in = Sliced(text, 3, rng);
  absl::StatusOr<ReceiveBuffers::Message> m = pool.Receive(in);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->bytes(), text);
  EXPECT_EQ(pool.stats().pinned_bytes, 0u);
  EXPECT_EQ(pool.stats().bytes, kMiB);
}

}  // namespace
}  // namespace verifyd
