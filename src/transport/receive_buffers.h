#pragma once
// Where a gRPC call's request message is received: its slices are copied once into one
// contiguous host buffer, and the message is parsed there in place (ParseRequestInPlace), so the
// inline bytes of q and kv_pool are not copied again by the parser. Buffers the pool keeps are
// pinned for the engine (cudaHostRegister on the CUDA engine), so the inputs go to the GPU
// straight from them, without the staging copy. Buffers come in power-of-two sizes (at least
// 1 MiB) and are kept for later calls up to `keep_bytes` in all; pinning a new one is slow (ms)
// and stalls the GPU for the calls in flight, so a steady load pins only while it warms up.

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "src/region/region_registry.h"

namespace verifyd {

class ReceiveBuffers {
 public:
  struct Stats {
    int64_t buffers = 0;  // in use or kept
    uint64_t bytes = 0;
    int64_t kept = 0;  // of those, waiting for a call
    uint64_t kept_bytes = 0;
    uint64_t pinned_bytes = 0;  // in use or kept, pinned
  };
  using Observer = std::function<void(const Stats&)>;

  // A received message: its bytes stay valid until this is destroyed, and its buffer then goes
  // back to the pool.
  class Message {
   public:
    Message() = default;
    ~Message();
    Message(Message&& o) noexcept;
    Message& operator=(Message&& o) noexcept;
    absl::string_view bytes() const { return {block_.base, size_}; }

   private:
    friend class ReceiveBuffers;
    struct Block {
      char* base = nullptr;
      uint64_t capacity = 0;
      std::function<void()> unpin;  // empty: not pinned
    };
    ReceiveBuffers* pool_ = nullptr;
    Block block_;
    uint64_t size_ = 0;
  };

  // `pin`: makes a buffer readable by the engine's devices (null: nothing is pinned). Only
  // buffers the pool can keep are pinned (none when keep_bytes is 0): one used once is not worth
  // it.
  ReceiveBuffers(uint64_t keep_bytes, RegionRegistry::HostPinner pin);
  ~ReceiveBuffers();
  ReceiveBuffers(const ReceiveBuffers&) = delete;
  ReceiveBuffers& operator=(const ReceiveBuffers&) = delete;

  // Copies `in`'s slices into a buffer and clears `in`. Each slice's wire bytes are freed as soon
  // as they are copied, so a message is held about once, not twice, while it is received.
  // RESOURCE_EXHAUSTED when no host memory is left for the buffer.
  absl::StatusOr<Message> Receive(grpc::ByteBuffer& in);

  Stats stats() const;
  // Called with the new stats whenever a buffer is made or freed.
  void SetObserver(Observer fn);

  // The size of the buffer a message of `bytes` bytes is received into.
  static uint64_t CapacityFor(uint64_t bytes);

 private:
  absl::StatusOr<Message::Block> Take(uint64_t capacity);
  void Give(Message::Block b);
  // Unpins and unmaps `b`; `counted`: it is in stats_ (and leaves them).
  void Free(Message::Block& b, bool counted);
  void Notify();

  const uint64_t keep_bytes_;
  const RegionRegistry::HostPinner pin_;
  mutable absl::Mutex mu_;
  std::vector<Message::Block> kept_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  Observer observer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
