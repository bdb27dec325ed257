#pragma once
// The custom kernel's schedules, by name. Three ship, one per architecture and pool type, and
// kAuto picks among them: on sm_90, v5t for a bf16 pool and v3e for an e4m3 pool; on any other
// device (and under VERIFYD_FORCE_SM120_CONFIG) the sm_120 tiles. verifyd's library compiles only
// those (custom_attention.cu). The others are bench-only: kernels/custom/variants compiles them
// for verifyd-bench, the kernel tests and the trace, to compare a new schedule against.

namespace verifyd::kernels {

enum class CustomSchedule {
  kAuto,
  // Shipped.
  kV5t,         // sm_90: v5 with the tree mask compiled only into the steps that reach the draft
  kV3e,         // sm_90, e4m3 pools only: v3 reading the codes, widened to bf16 in shared memory
  kSmallTiles,  // 32 rows x 16 tokens on mma.sync (~99 KB of shared memory): sm_120 and the rest
  // Bench-only (variants/custom_variants.h), all on the Hopper tiles of an sm_90 device.
  kV5,           // the seesaw over pairs of tiles: a whole tile's Q·Kᵀ per warpgroup
  kV5s,          // v5 with warpgroup 1's Q·Kᵀ issued after warpgroup 0's
  kV4,           // wgmma for both products, the warpgroups' softmax and P·V in turn
  kV4SplitK,     // v4 with Q·Kᵀ split over the 576 dims between the warpgroups
  kV4TwoChain,   // v4 with Q·Kᵀ's k steps in two accumulator chains per warpgroup
  kV3,           // wgmma for both products, both warpgroups' softmax in step
  kWgmmaScores,  // wgmma for Q·Kᵀ only
  kMmaSync,      // the Hopper tiles on mma.sync
};

constexpr bool ScheduleShipped(CustomSchedule s) {
  return s == CustomSchedule::kAuto || s == CustomSchedule::kV5t || s == CustomSchedule::kV3e ||
         s == CustomSchedule::kSmallTiles;
}

// Only v3e reads an e4m3 pool's codes, and it reads nothing else.
constexpr bool ScheduleReadsE4m3(CustomSchedule s) { return s == CustomSchedule::kV3e; }

// The schedules whose kernels make the in-process op's checks (kernel_checks.cuh).
constexpr bool ScheduleChecksInKernel(CustomSchedule s) { return s == CustomSchedule::kV5t; }

// "v5t", "v3e", "sm120", "v5", ...: the name verifyd-bench's paths, the tests and the logs use.
constexpr const char* ScheduleName(CustomSchedule s) {
  switch (s) {
    case CustomSchedule::kAuto:
      return "auto";
    case CustomSchedule::kV5t:
      return "v5t";
    case CustomSchedule::kV3e:
      return "v3e";
    case CustomSchedule::kSmallTiles:
      return "sm120";
    case CustomSchedule::kV5:
      return "v5";
    case CustomSchedule::kV5s:
      return "v5s";
    case CustomSchedule::kV4:
      return "v4";
    case CustomSchedule::kV4SplitK:
      return "v4k";
    case CustomSchedule::kV4TwoChain:
      return "v4c";
    case CustomSchedule::kV3:
      return "v3";
    case CustomSchedule::kWgmmaScores:
      return "qkwgmma";
    case CustomSchedule::kMmaSync:
      return "mma";
  }
  return "?";
}

}  // namespace verifyd::kernels
