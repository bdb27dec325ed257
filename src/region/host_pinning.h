#pragma once
// Pinning host memory that calls read in place (shm regions, call channels' areas, the buffers
// gRPC messages are received into), so that the CUDA engine's copy engines read it directly. One
// place for the attempt, its timing and the warning when it fails.

#include <cstdint>
#include <functional>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace verifyd {

// Pins [base, base + bytes) (the engine's cudaHostRegister); returns what unpins it, or an empty
// function where the engine has nothing to pin (the CPU engine). An error leaves the memory
// usable, through staging copies.
using HostPinner = std::function<absl::StatusOr<std::function<void()>>(char* base, uint64_t bytes)>;

struct PinnedHost {
  std::function<void()> unpin;  // empty: not pinned
  absl::Duration took;          // how long the attempt took
};

// Pins with `pin` (nothing when it is empty). A failure is logged as a warning naming `what`
// ("region 'kv'", "receive buffer of 64 MiB") and returns no unpin: calls then stage the memory
// through a copy.
PinnedHost PinHost(const HostPinner& pin, char* base, uint64_t bytes, std::string_view what);

}  // namespace verifyd
