#pragma once
// The shared-memory layout of a call channel (verify.proto, OpenChannel), defined once for
// verifyd and its clients. The object's first kHeaderBytes hold the Header; the request area and
// the response area follow, `capacity` bytes each. verifyd writes the header when it opens the
// channel; from then on the client owns request_bytes and request_seq, verifyd response_bytes,
// response_seq and state.
//
// One call: the client writes the serialized VerifyRequest at request_offset and its size into
// request_bytes, then stores request_seq + 1 (release) and wakes request_seq. verifyd sees the
// new sequence number (acquire) and parses the request where it is: it copies out everything it
// checks (the client can write the area at any time), and reads the inline bytes of q and kv_pool,
// which no check reads, in place (ParseRequestInPlace). It serves the call, writes the serialized
// VerifyResponse and its size, then stores the request's sequence number into response_seq
// (release) and wakes it. The client waits for response_seq to reach its number, and leaves the
// request area alone until then: bytes it changes earlier may reach the call. A channel serves
// one call at a time.
//
// A channel opened with call descriptors is in doorbell mode instead: see doorbell_layout.h; one
// opened with a tap is in tap mode: see tap_layout.h.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace verifyd::channel {

inline constexpr uint64_t kMagic = 0x314e484344594656ull;  // "VFYDCHN1", little-endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kAreaAlign = 64;
// The smallest channel: the header and two areas of 4 KiB.
inline constexpr uint64_t kMinBytes = kHeaderBytes + 2 * 4096;

enum State : uint32_t { kStateOpen = 1, kStateClosed = 2 };

// Words two processes share: each is a lock-free 32-bit atomic (a futex word).
struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t capacity;
  alignas(64) std::atomic<uint32_t> request_seq;
  std::atomic<uint32_t> request_bytes;
  alignas(64) std::atomic<uint32_t> response_seq;
  std::atomic<uint32_t> response_bytes;
  alignas(64) std::atomic<uint32_t> state;
  // Doorbell mode only (doorbell_layout.h): written by the client's GPU, and by verifyd.
  alignas(64) std::atomic<uint32_t> doorbell;
  alignas(64) std::atomic<uint32_t> done;
  alignas(64) std::atomic<uint32_t> failed_calls;  // verifyd: calls answered with an error
  // Tap mode only (tap_layout.h). The tap kernel writes these four, in this order (32-bit
  // counts that wrap): ring fills published, calls, sampled calls, sampled calls dropped.
  alignas(64) std::atomic<uint32_t> tap_produced;
  std::atomic<uint32_t> tap_calls, tap_taps, tap_dropped;
  // verifyd: ring fills it is done with, of which compared and refused.
  alignas(64) std::atomic<uint32_t> tap_consumed;
  std::atomic<uint32_t> tap_compared, tap_refused;
};
static_assert(sizeof(Header) <= kHeaderBytes);
// Clients outside C++ (clients/python/verifyd_client/tap.py, doorbell.py) use these offsets.
static_assert(offsetof(Header, doorbell) == 256 && offsetof(Header, done) == 320);
static_assert(offsetof(Header, failed_calls) == 384 && offsetof(Header, tap_produced) == 448);
static_assert(offsetof(Header, tap_consumed) == 512);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct Geometry {
  uint32_t capacity = 0;  // bytes of each area
  uint64_t request_offset = 0, response_offset = 0;
};

// The areas of a channel of `byte_size` bytes: each (byte_size - kHeaderBytes) / 2, rounded down
// to kAreaAlign and capped at `max_capacity`. INVALID_ARGUMENT naming byte_size below kMinBytes.
absl::StatusOr<Geometry> GeometryFor(uint64_t byte_size, uint64_t max_capacity);

// verifyd's side. Writes a fresh header: no call yet, state open.
void InitHeader(char* base, const Geometry& g);
// The request the client left (request_bytes at request_offset), where it is; the size is read
// once. INVALID_ARGUMENT naming request_bytes when it claims more than the area holds, or zero
// bytes.
absl::StatusOr<absl::string_view> RequestIn(const char* base, const Geometry& g);
// Where verifyd writes the answer: `capacity` bytes.
inline char* ResponseArea(char* base, const Geometry& g) { return base + g.response_offset; }
// Publishes the `bytes` (at most capacity) written at ResponseArea as the answer to call `seq`.
void PublishResponse(char* base, uint32_t bytes, uint32_t seq);

inline Header* HeaderOf(char* base) { return reinterpret_cast<Header*>(base); }
inline const Header* HeaderOf(const char* base) { return reinterpret_cast<const Header*>(base); }

}  // namespace verifyd::channel
