#pragma once
// How the fused kernel cuts a problem: query rows per CTA, KV tokens per tile, and the KV split
// (flash-decoding) chosen from the problem size and the number of multiprocessors.
// Plain C++: the launcher, the workspace query and the tests share it.

#include <cstddef>
#include <cstdint>

#include "kernels/custom/custom_schedule.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// The two compile-time tile configurations of the kernel.
struct CustomTileShape {
  int rows;           // query rows (of a request's T*H) per CTA
  int tokens;         // KV tokens per pipeline stage
  int stages;         // cp.async pipeline depth
  int threads;        // CTA size
  size_t smem_bytes;  // dynamic shared memory per CTA
};

constexpr size_t CustomTileSmemBytes(int rows, int tokens, int stages) {
  const size_t r = static_cast<size_t>(rows), t = static_cast<size_t>(tokens);
  const size_t row_bytes = size_t{kHeadDimQK} * 2;
  return r * row_bytes                                  // Q tile
         + static_cast<size_t>(stages) * t * row_bytes  // K/V stages
         + r * (t + 8) * 2                              // P tile (bf16, padded rows)
         + 3 * r * 4                                    // row max/sum exchange, row scale
         + r * (t / 16) * 2                             // staged tree-mask bits
         + static_cast<size_t>(stages) * t * 4;         // page ids of the next tiles' rows
}

// Hopper (H100/H200, 227 KB per block): 64 rows x 64 tokens, 2 stages, 8 warps.
constexpr CustomTileShape HopperTileShape() {
  return {64, 64, 2, 256, CustomTileSmemBytes(64, 64, 2)};
}
// sm_120 (RTX PRO 6000, 99 KB per block): 32 rows x 16 tokens, 3 stages, 4 warps.
constexpr CustomTileShape Sm120TileShape() {
  return {32, 16, 3, 128, CustomTileSmemBytes(32, 16, 3)};
}

struct CustomPlan {
  CustomSchedule schedule = CustomSchedule::kSmallTiles;  // never kAuto once resolved
  CustomTileShape tiles{};
  int row_blocks = 0;     // ceil(T*H / tiles.rows)
  int64_t max_tiles = 0;  // ceil(max_kv_len / tiles.tokens)
  int splits = 1;         // KV splits per (request, row block)
  int64_t tiles_per_split = 0;
  size_t workspace_bytes = 0;  // fp32 partial o [splits, B*T*H, 512] + lse [splits, B*T*H]
  size_t partial_lse_offset = 0;
};

// The tiles, KV split and workspace of a problem. `schedule` is the tiles' shipped one (v5t or the
// sm_120 tiles); the launcher's resolution (ResolveCustomPlan) names the one that runs.
// `ctas_per_sm`: how many CTAs of the chosen configuration one multiprocessor holds.
// `force_splits` > 0 fixes the split count (clamped to [1, max_tiles]).
CustomPlan PlanCustom(const VerifyProblem& p, bool small_tiles, int num_sms, int ctas_per_sm,
                      int force_splits);

}  // namespace verifyd::kernels
