#include "src/transport/receive_buffers.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/region/host_pinning.h"

namespace verifyd {
namespace {

constexpr uint64_t kMinCapacity = uint64_t{1} << 20;

}  // namespace

ReceiveBuffers::Message::~Message() {
  if (pool_ != nullptr) pool_->Give(std::move(block_));
}

ReceiveBuffers::Message::Message(Message&& o) noexcept
    : pool_(std::exchange(o.pool_, nullptr)),
      block_(std::exchange(o.block_, Block{})),
      size_(std::exchange(o.size_, 0)) {}

ReceiveBuffers::Message& ReceiveBuffers::Message::operator=(Message&& o) noexcept {
  if (this != &o) {
    if (pool_ != nullptr) pool_->Give(std::move(block_));
    pool_ = std::exchange(o.pool_, nullptr);
    block_ = std::exchange(o.block_, Block{});
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

ReceiveBuffers::ReceiveBuffers(uint64_t keep_bytes, RegionRegistry::HostPinner pin)
    : keep_bytes_(keep_bytes), pin_(keep_bytes > 0 ? std::move(pin) : nullptr) {}

ReceiveBuffers::~ReceiveBuffers() {
  std::vector<Message::Block> kept;
  {
    absl::MutexLock l(&mu_);
    kept.swap(kept_);
  }
  for (Message::Block& b : kept) Free(b, false);
}

uint64_t ReceiveBuffers::CapacityFor(uint64_t bytes) {
  uint64_t c = kMinCapacity;
  while (c < bytes) c *= 2;
  return c;
}

void ReceiveBuffers::SetObserver(Observer fn) {
  absl::MutexLock l(&mu_);
  observer_ = std::move(fn);
}

void ReceiveBuffers::Notify() {
  Stats s;
  Observer fn;
  {
    absl::MutexLock l(&mu_);
    s = stats_;
    fn = observer_;
  }
  if (fn) fn(s);
}

void ReceiveBuffers::Free(Message::Block& b, bool counted) {
  if (counted) {
    absl::MutexLock l(&mu_);
    stats_.buffers -= 1;
    stats_.bytes -= b.capacity;
    if (b.unpin) stats_.pinned_bytes -= b.capacity;
  }
  if (b.unpin) b.unpin();
  if (b.base != nullptr) munmap(b.base, b.capacity);
  b = Message::Block{};
  if (counted) Notify();
}

absl::StatusOr<ReceiveBuffers::Message::Block> ReceiveBuffers::Take(uint64_t capacity) {
  {
    absl::MutexLock l(&mu_);
    auto it = std::find_if(kept_.begin(), kept_.end(),
                           [capacity](const Message::Block& b) { return b.capacity == capacity; });
    if (it != kept_.end()) {
      Message::Block b = std::move(*it);
      kept_.erase(it);
      stats_.kept -= 1;
      stats_.kept_bytes -= b.capacity;
      return b;
    }
  }
  Message::Block b;
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("no host memory for a ", capacity >> 20,
                                                     " MiB buffer to receive the message into"));
  }
  b.base = static_cast<char*>(p);
  b.capacity = capacity;
  // A buffer larger than the pool keeps is freed after its call: pinning it would cost more than
  // the staging copy it saves.
  if (capacity <= keep_bytes_) {
    PinnedHost pinned =
        PinHost(pin_, b.base, capacity, absl::StrCat("receive buffer of ", capacity >> 20, " MiB"));
    b.unpin = std::move(pinned.unpin);
    if (b.unpin) {
      spdlog::info("receive buffer of {} MiB pinned in {:.1f} ms", capacity >> 20,
                   absl::ToDoubleMilliseconds(pinned.took));
    }
  }
  {
    absl::MutexLock l(&mu_);
    stats_.buffers += 1;
    stats_.bytes += capacity;
    if (b.unpin) stats_.pinned_bytes += capacity;
  }
  Notify();
  return b;
}

void ReceiveBuffers::Give(Message::Block b) {
  {
    absl::MutexLock l(&mu_);
    if (stats_.kept_bytes + b.capacity <= keep_bytes_) {
      stats_.kept += 1;
      stats_.kept_bytes += b.capacity;
      kept_.push_back(std::move(b));
      return;
    }
  }
  Free(b, true);
}

absl::StatusOr<ReceiveBuffers::Message> ReceiveBuffers::Receive(grpc::ByteBuffer& in) {
  std::vector<grpc::Slice> slices;
  if (!in.Dump(&slices).ok()) return absl::InternalError("the message's bytes could not be read");
  const uint64_t size = in.Length();
  in.Clear();  // `slices` now hold the wire bytes' only references
  absl::StatusOr<Message::Block> b = Take(CapacityFor(size));
  if (!b.ok()) return b.status();
  Message m;
  m.pool_ = this;
  m.block_ = *std::move(b);
  m.size_ = size;
  uint64_t at = 0;
  for (grpc::Slice& s : slices) {
    std::memcpy(m.block_.base + at, s.begin(), s.size());
    at += s.size();
    s = grpc::Slice();  // each slice's bytes go as soon as they are copied
  }
  return m;
}

ReceiveBuffers::Stats ReceiveBuffers::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

}  // namespace verifyd
