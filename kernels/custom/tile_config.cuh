#pragma once
// Compile-time tile configurations of the fused kernel and their shared-memory layout.
//
// A CTA owns kRows query rows of one request (rows r = token * H + head of the request's T*H)
// and streams the request's KV in tiles of kTokens rows x 576 dims. Its warps take two roles:
//   S phase:  (kRows/16) row groups x 2 key halves; a warp computes a 16 x kTokens/2 score tile
//             over all 576 dims and the online softmax of its rows.
//   PV phase: (kRows/32) row pairs x 4 quarters of the 512 output dims; a warp keeps a
//             32 x 128 fp32 accumulator (128 registers per thread) and multiplies P by V.
//             (The wgmma P·V of the Hopper tiles instead gives warpgroup w rows 0..63 x dims
//             [256w, 256w + 256): again 128 fp32 registers per thread.)
// Both roles cover all kRows/8 warps. The layout is shared memory in bytes:
//   Q [kRows, 576] | KV [kStages, kTokens, 576] | P [kRows, kTokens + 8] bf16 |
//   red [2, kRows] f32 | scale [kRows] f32 | mask [kRows, kTokens/16] u16 |
//   page ids [kStages, kTokens] i32 (of the rows of the tiles the pipeline loads next)
// Q and KV tiles are stored as 9 blocks of 64 dims: block kb holds [rows, 128 bytes] with the
// 16-byte chunks of row r XOR-swizzled by (r & 7). That is wgmma's K-major 128-byte-swizzle
// layout (8-row atoms of 1024 bytes), and ldmatrix reads of 8 consecutive rows hit 8 different
// bank groups. Q, KV stages and the 64-dim blocks all start 1024-byte aligned.

#include <cstddef>
#include <cstdint>

#include "kernels/verify_problem.h"

namespace verifyd::kernels::custom {

template <int kRowsT, int kTokensT, int kStagesT>
struct TileConfig {
  static constexpr int kRows = kRowsT;
  static constexpr int kTokens = kTokensT;
  static constexpr int kStages = kStagesT;
  static constexpr int kWarps = kRows / 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowGroups = kRows / 16;    // S phase
  static constexpr int kNTilesS = kTokens / 16;    // 8-key mma tiles per S warp
  static constexpr int kRowPairs = kRows / 32;     // PV phase
  static constexpr int kMaskWords = kTokens / 16;  // 16-bit words of mask per token and tile
  static constexpr int kRowBytes = kHeadDimQK * 2;
  static constexpr int kChunksPerRow = kRowBytes / 16;  // 72
  static constexpr int kKSteps = kHeadDimQK / 16;       // 36
  static constexpr int kPStride = kTokens + 8;          // bf16 elements; breaks bank conflicts
  static constexpr int kQBlockBytes = kRows * 128;      // one 64-dim block of the Q tile
  static constexpr int kKvBlockBytes = kTokens * 128;   // one 64-dim block of a KV stage

  static constexpr size_t kQOffset = 0;
  static constexpr size_t kKvOffset = kQOffset + size_t{kRows} * kRowBytes;
  static constexpr size_t kStageBytes = size_t{kTokens} * kRowBytes;
  static constexpr size_t kPOffset = kKvOffset + kStages * kStageBytes;
  static constexpr size_t kRedOffset = kPOffset + size_t{kRows} * kPStride * 2;
  static constexpr size_t kScaleOffset = kRedOffset + size_t{2} * kRows * 4;
  static constexpr size_t kMaskOffset = kScaleOffset + size_t{kRows} * 4;
  static constexpr size_t kPageIdOffset = kMaskOffset + size_t{kRows} * kMaskWords * 2;
  static constexpr size_t kSmemBytes = kPageIdOffset + size_t{kStages} * kTokens * 4;

  static_assert(kRows % 32 == 0 && kTokens % 16 == 0, "tile sizes");
  static_assert(kRows * kMaskWords <= kThreads * 4, "mask staging work per thread");
  static_assert(kRows % (kThreads / 8) == 0 && kTokens % (kThreads / 8) == 0, "row loader passes");
  static_assert(kStages >= 2, "pipeline depth");
  static_assert(kTokens <= kThreads && kPageIdOffset % 4 == 0, "page id prefetch");
  static_assert(kKvOffset % 1024 == 0 && kStageBytes % 1024 == 0 && kKvBlockBytes % 1024 == 0 &&
                    kQBlockBytes % 1024 == 0,
                "128-byte-swizzle atoms must stay 1024-byte aligned");
};

// H100/H200: 232,192 bytes of the 232,448 a block may opt into.
using HopperTiles = TileConfig<64, 64, 2>;
// RTX PRO 6000 (sm_120): 94,336 bytes of its 101,376.
using Sm120Tiles = TileConfig<32, 16, 3>;

}  // namespace verifyd::kernels::custom
