#pragma once
// The fused paged MLA tree-verify attention kernel.
//
// grid (ceil(T*H / kRows), splits, B), block Cfg::kThreads. CTA (mb, s, b) computes query rows
// [mb*kRows, (mb+1)*kRows) of request b (row = token * H + head) against KV tiles
// [s*tiles_per_split, (s+1)*tiles_per_split) of that request:
//   q [B*T*H, 576] bf16, kv_pool [pages*page_size, 576] bf16 (gathered through kv_indices),
//   o [B*T*H, 512] bf16 + lse [B*T*H] f32 when splits == 1, else fp32 partials for the combine.
// Every KV tile is read from memory once per CTA and used for Q·Kᵀ (576 dims) and P·V (its
// first 512 dims). Only tiles that reach the draft tail read the tree mask.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/custom/device_primitives.cuh"
#include "kernels/custom/kernel_epilogue.cuh"
#include "kernels/custom/kernel_params.h"
#include "kernels/custom/tile_config.cuh"

namespace verifyd::kernels::custom {

// Issues cp.async for kNumRows rows of 576 bf16 into a tile laid out as in tile_config.cuh.
// `row_src(r, &valid)` gives row r's global address (any mapped address when !valid: the row is
// zero-filled). Eight threads share a row, so a warp reads four rows' 128-byte runs per
// instruction.
template <class Cfg, int kNumRows, class RowSrc>
__device__ __forceinline__ void LoadRows(uint32_t tile, int tid, RowSrc row_src) {
  constexpr int kRowsPerPass = Cfg::kThreads / 8;
  const int sub = tid & 7;
#pragma unroll
  for (int pass = 0; pass < kNumRows / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + (tid >> 3);
    bool valid;
    const uint16_t* src = row_src(r, &valid);
    const uint32_t dst = tile + r * 128 + ((sub ^ (r & 7)) << 4);
#pragma unroll
    for (int c = 0; c < Cfg::kChunksPerRow / 8; ++c) {
      CpAsync16(dst + c * (kNumRows * 128), src + (c * 8 + sub) * 8, valid);
    }
  }
}

// An e4m3 pool's rows (576 one-byte codes) land in the upper half of each 64-dim block of a KV
// stage: block c of row r's codes at c * kKvBlockBytes + kKvBlockBytes / 2 + r * 64, unswizzled.
// WidenE4m3Stage then rewrites each block in place as the bf16 rows the other loads give.
template <class Cfg, int kNumRows, class RowSrc>
__device__ __forceinline__ void LoadRowsE4m3(uint32_t stage, int tid, RowSrc row_src) {
  constexpr int kRowsPerPass = Cfg::kThreads / 8;
  constexpr int kHalf = Cfg::kKvBlockBytes / 2;
  const int sub = tid & 7;
#pragma unroll
  for (int pass = 0; pass < kNumRows / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + (tid >> 3);
    bool valid;
    const uint8_t* src = row_src(r, &valid);
    const uint32_t dst = stage + kHalf + r * 64 + sub * 8;
#pragma unroll
    for (int c = 0; c < Cfg::kChunksPerRow / 8; ++c) {
      CpAsync8(dst + c * Cfg::kKvBlockBytes, src + c * 64 + sub * 8, valid);
    }
  }
}

// Widens the e4m3 codes LoadRowsE4m3 landed in a stage (after the CTA's barrier that follows
// their arrival) to bf16 in the swizzled layout of tile_config.cuh, block by block. A block's
// rows of the lower half are written outside the codes (into the first kKvBlockBytes / 2 bytes);
// those of the upper half overwrite codes, so every thread reads its codes of them first and
// writes them after a barrier. Ends with the stage visible to the async proxy (wgmma) and to
// every thread.
template <class Cfg>
__device__ __forceinline__ void WidenE4m3Stage(uint8_t* stage, int tid) {
  static_assert(Cfg::kTokens * 8 == 2 * Cfg::kThreads, "one chunk of each half per thread");
  constexpr int kHalf = Cfg::kKvBlockBytes / 2;
  constexpr int kBlocks = Cfg::kChunksPerRow / 8;
  const int sub = tid & 7;
  const int r_lo = tid >> 3, r_hi = r_lo + Cfg::kTokens / 2;
  uint2 hi[kBlocks];
#pragma unroll
  for (int c = 0; c < kBlocks; ++c) {
    uint8_t* block = stage + c * Cfg::kKvBlockBytes;
    hi[c] = *reinterpret_cast<const uint2*>(block + kHalf + r_hi * 64 + sub * 8);
    const uint2 lo = *reinterpret_cast<const uint2*>(block + kHalf + r_lo * 64 + sub * 8);
    *reinterpret_cast<uint4*>(block + r_lo * 128 + ((sub ^ (r_lo & 7)) << 4)) = E4m3x8ToBf16x8(lo);
  }
  __syncthreads();  // every code of the upper halves is read
#pragma unroll
  for (int c = 0; c < kBlocks; ++c) {
    uint8_t* block = stage + c * Cfg::kKvBlockBytes;
    *reinterpret_cast<uint4*>(block + r_hi * 128 + ((sub ^ (r_hi & 7)) << 4)) =
        E4m3x8ToBf16x8(hi[c]);
  }
  FenceProxyAsyncShared();
  __syncthreads();
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Named barriers of the seesaw handoffs (1..4 are the v3 row-group exchanges), each between the
// two warpgroups (256 threads) once per tile. The two warpgroups reach them at different places
// in the code, hence the non-.aligned barrier.sync; both sides wait (a one-way bar.arrive on the
// producing side timed the same, and compute-sanitizer's racecheck cannot follow it).
inline constexpr int kBarMaxHalf0 = 5;  // warpgroup 0's row max (after its keys) is in red[0, 64)
inline constexpr int kBarHalf1 = 6;     // warpgroup 1's row max in red[64, 128), its P in P
inline constexpr int kBarPHalf0 = 7;    // warpgroup 0's P (at warpgroup 1's max) is in P
inline constexpr int kBarSplitK = 8;    // split-K score halves exchanged (same instruction)

// S = Q Kᵀ of all 64 rows x 32 keys (K tile rows at kv_keys) over the 576 dims, as wgmma
// m64n32k16 (36 k steps) in one warpgroup; s as mma.sync's C fragments. With kChains = 2 the k
// steps alternate between two accumulators (even, odd), summed at the end: two independent
// dependency chains of 18 instead of one of 36, the same instructions and operand reads.
template <class Cfg, int kChains>
__device__ __forceinline__ void ScoresWgmma(float (&s)[Cfg::kNTilesS][4], uint32_t q_s,
                                            uint32_t kv_keys) {
  static_assert(kChains == 1 || kChains == 2, "one or two accumulator chains");
  static_assert(Cfg::kKSteps % kChains == 0, "the chains share the k steps evenly");
  float acc[kChains][16];
#pragma unroll
  for (int c = 0; c < kChains; ++c)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[c][i] = 0.f;
  const uint64_t desc_a = SmemDescSw128(q_s);
  const uint64_t desc_b = SmemDescSw128(kv_keys);
#pragma unroll
  for (int c = 0; c < kChains; ++c) FenceOperands(acc[c]);
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
    // Descriptor addresses count 16-byte units.
    const uint64_t a_off = ((kk >> 2) * Cfg::kQBlockBytes + (kk & 3) * 32) >> 4;
    const uint64_t b_off = ((kk >> 2) * Cfg::kKvBlockBytes + (kk & 3) * 32) >> 4;
    WgmmaM64N32K16(acc[kk % kChains], desc_a + a_off, desc_b + b_off);
  }
  WgmmaCommit();
  WgmmaWait<0>();
#pragma unroll
  for (int c = 0; c < kChains; ++c) FenceOperands(acc[c]);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float v = acc[0][i];
#pragma unroll
    for (int c = 1; c < kChains; ++c) v += acc[c][i];
    s[i / 4][i % 4] = v;
  }
}

// P (fp32, log2-domain exponent minus the row max) of this thread's 2 rows x 32 keys, as the A
// fragments of two K = 16 steps of a register-A wgmma.
__device__ __forceinline__ void PackPFragments(const float (&pv)[4][4], uint32_t (&a)[2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    a[kk][0] = PackBf16x2(pv[2 * kk][0], pv[2 * kk][1]);
    a[kk][1] = PackBf16x2(pv[2 * kk][2], pv[2 * kk][3]);
    a[kk][2] = PackBf16x2(pv[2 * kk + 1][0], pv[2 * kk + 1][1]);
    a[kk][3] = PackBf16x2(pv[2 * kk + 1][2], pv[2 * kk + 1][3]);
  }
}

// Writes this thread's P values (rows row, row + 8; keys key0 + 8j + 2tq (+1)) into the
// 128-byte-swizzled [64 rows, 64 keys] P tile that wgmma reads as a K-major A operand.
__device__ __forceinline__ void StorePTile(const float (&pv)[4][4], int row, int key0, int tq,
                                           uint32_t* p_words) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = key0 + j * 8 + 2 * tq;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row + 8 * hh;
      p_words[(r * 128 + (((col >> 3) ^ (r & 7)) << 4) + (col & 7) * 2) >> 2] =
          PackBf16x2(pv[j][2 * hh], pv[j][2 * hh + 1]);
    }
  }
}

// One KV tile of the seesaw schedule. Warpgroup w holds scores s of all 64 rows x keys
// [32w, 32w + 32) (log2 domain, masked) with their row maxima mx, and owns output dims
// [256w, 256w + 256) in o_acc. The running max m is the same in both warpgroups. In turn:
//   [0] m0 = max(m, mx0); o_L = o_L * 2^(m - m0) + P0(m0) V0_L        (P0 from registers)
//   [1] m1 = max(m0, mx1); o_R = o_R * 2^(m - m1) + P1(m1) V1_R        (P1 from registers)
//   [0] o_L = o_L * 2^(m0 - m1) + P1 V1_L ;  [1] o_R += P0(m1) V0_R     (from shared memory)
// so one warpgroup's exponentials run while the other's P·V is on the tensor cores. Row sums
// l follow o. Rows with nothing visible keep m = -inf and compute with 0 (exp2(-inf) = 0).
template <class Cfg>
__device__ __forceinline__ void SeesawTile(float (&s)[4][4], const float (&mx)[2],
                                           float (&m_run)[2], float (&l_run)[2],
                                           float (&o_acc)[128], int half, int row, int key0, int tq,
                                           float* red, uint32_t* p_words, uint32_t p_s,
                                           uint32_t kv_tile) {
  constexpr int kRows = Cfg::kRows;
  const uint64_t desc_v =
      SmemDescSw128MnMajor(kv_tile + half * 4 * Cfg::kKvBlockBytes, Cfg::kKvBlockBytes);
  const uint64_t desc_p = SmemDescSw128(p_s);
  // K steps (16 keys) of the tile: warpgroup w's own keys are steps 2w, 2w + 1.
  auto v_step = [&](int ks) { return desc_v + ((ks * 16 * 128) >> 4); };
  auto p_step = [&](int ks) { return desc_p + ((ks * 32) >> 4); };
  auto scale_o = [&](const float(&f)[2]) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o_acc[4 * j] *= f[0];
      o_acc[4 * j + 1] *= f[0];
      o_acc[4 * j + 2] *= f[1];
      o_acc[4 * j + 3] *= f[1];
    }
  };
  auto exp_rows = [&](const float(&m_use)[2], float(&pv)[4][4], float(&rowsum)[2]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pv[j][e] = FastExp2(s[j][e] - m_use[e >> 1]);
        rowsum[e >> 1] += pv[j][e];
      }
  };
  float pv[4][4], rowsum[2] = {0.f, 0.f}, f[2];
  uint32_t a[2][4];
  if (half == 0) {
    float m0[2], m0_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m0[i] = fmaxf(m_run[i], mx[i]);
      m0_use[i] = m0[i] == -INFINITY ? 0.f : m0[i];
      f[i] = FastExp2(m_run[i] - m0_use[i]);
      if (tq == 0) red[row + 8 * i] = m0[i];
    }
    NamedBarrierAnyPc(kBarMaxHalf0, 2 * 128);
    exp_rows(m0_use, pv, rowsum);
    PackPFragments(pv, a);
#pragma unroll
    for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * f[i] + rowsum[i];
    scale_o(f);
    FenceOperands(o_acc);
    WgmmaFence();
    WgmmaM64N256K16RegATransB(o_acc, a[0], v_step(0));
    WgmmaM64N256K16RegATransB(o_acc, a[1], v_step(1));
    WgmmaCommit();
    // Warpgroup 1's max and its P are published.
    NamedBarrierAnyPc(kBarHalf1, 2 * 128);
    float m1[2], m1_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m1[i] = red[kRows + row + 8 * i];
      m1_use[i] = m1[i] == -INFINITY ? 0.f : m1[i];
      f[i] = FastExp2(m0[i] - m1_use[i]);
      l_run[i] *= f[i];
      rowsum[i] = 0.f;
    }
    exp_rows(m1_use, pv, rowsum);
    StorePTile(pv, row, key0, tq, p_words);
    FenceProxyAsyncShared();
    NamedBarrierAnyPc(kBarPHalf0, 2 * 128);
    WgmmaWait<0>();
    FenceOperands(o_acc);
    scale_o(f);
    FenceOperands(o_acc);
    WgmmaFence();
    WgmmaM64N256K16TransB(o_acc, p_step(2), v_step(2));
    WgmmaM64N256K16TransB(o_acc, p_step(3), v_step(3));
    WgmmaCommit();
    WgmmaWait<0>();
    FenceOperands(o_acc);
#pragma unroll
    for (int i = 0; i < 2; ++i) m_run[i] = m1[i];
  } else {
    NamedBarrierAnyPc(kBarMaxHalf0, 2 * 128);
    float m1[2], m1_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m1[i] = fmaxf(red[row + 8 * i], mx[i]);
      m1_use[i] = m1[i] == -INFINITY ? 0.f : m1[i];
      f[i] = FastExp2(m_run[i] - m1_use[i]);
      if (tq == 0) red[kRows + row + 8 * i] = m1[i];
    }
    exp_rows(m1_use, pv, rowsum);
    StorePTile(pv, row, key0, tq, p_words);
    FenceProxyAsyncShared();
    NamedBarrierAnyPc(kBarHalf1, 2 * 128);
    PackPFragments(pv, a);
#pragma unroll
    for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * f[i] + rowsum[i];
    scale_o(f);
    FenceOperands(o_acc);
    WgmmaFence();
    WgmmaM64N256K16RegATransB(o_acc, a[0], v_step(2));
    WgmmaM64N256K16RegATransB(o_acc, a[1], v_step(3));
    WgmmaCommit();
    // Warpgroup 0's P at this tile's final max is in shared memory.
    NamedBarrierAnyPc(kBarPHalf0, 2 * 128);
    WgmmaFence();
    WgmmaM64N256K16TransB(o_acc, p_step(0), v_step(0));
    WgmmaM64N256K16TransB(o_acc, p_step(1), v_step(1));
    WgmmaCommit();
    WgmmaWait<0>();
    FenceOperands(o_acc);
#pragma unroll
    for (int i = 0; i < 2; ++i) m_run[i] = m1[i];
  }
}
#endif

// On sm_90a with the Hopper tiles the tensor cores can read their operands straight from
// shared memory (wgmma):
//   kWgmmaS:  Q·Kᵀ as wgmma m64n32k16, one warpgroup per key half. Otherwise mma.sync fed by
//             ldmatrix; both hand the softmax the same fragment layout.
//   kWgmmaPV: P·V as wgmma m64n256k16, one warpgroup per half of the 512 output dims, P from a
//             128-byte-swizzled tile, V read MN-major from the KV stage. Otherwise mma.sync with
//             the PV role of tile_config.cuh. Needs kWgmmaS's warp-to-row mapping (warp w:
//             rows 16*(w%4), warpgroup w/4), which the S role already has.
//   kSeesaw:  with kWgmmaPV, the two warpgroups' softmax and P·V of a tile in turn
//             (SeesawTile), and the split combine may launch early (programmatic dependent
//             launch). kSplitK: with kSeesaw, Q·Kᵀ as m64n64k16 per warpgroup over half of the
//             576 dims, the partial scores exchanged through shared memory. kTwoChainS: with
//             kSeesaw, the wgmma Q·Kᵀ in two accumulator chains (ScoresWgmma<Cfg, 2>).
//   kE4m3:    the pool holds e4m3 codes (p.kv_pool is their bytes): each tile lands at one byte
//             an element and is widened to bf16 in shared memory (LoadRowsE4m3, WidenE4m3Stage);
//             kv_scale is in p.scale_log2 and p.o_scale (v3e, with kWgmmaPV and no seesaw).
// Anywhere else (sm_120, or the sm_120 tiles) all of them run as mma.sync.
template <class Cfg, bool kWgmmaS, bool kWgmmaPV, bool kSeesaw = false, bool kSplitK = false,
          bool kTwoChainS = false, bool kE4m3 = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) FusedVerifyKernel(const KernelParams p) {
  if (SkipLaunch(p)) return;  // uniform: before any barrier
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kRows = Cfg::kRows, kTokens = Cfg::kTokens, kStages = Cfg::kStages;
  static_assert(kWgmmaS || !kWgmmaPV, "wgmma P·V comes with wgmma Q·Kᵀ");
  static_assert(kWgmmaPV || !kSeesaw, "the seesaw schedule is a wgmma P·V schedule");
  static_assert(kSeesaw || !kSplitK, "split-K scores come with the seesaw schedule");
  static_assert(kSeesaw || !kTwoChainS, "two-chain scores come with the seesaw schedule");
  static_assert(!(kSplitK && kTwoChainS), "split-K and two-chain scores are separate variants");
  static_assert(!kE4m3 || (kWgmmaPV && !kSeesaw), "e4m3 loads come with v3's schedule");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kUseWgmma = kWgmmaS;
  constexpr bool kUseWgmmaPV = kWgmmaPV;
  constexpr bool kUseSeesaw = kSeesaw;
  constexpr bool kUseSplitK = kSplitK;
  static_assert(!kWgmmaS || (Cfg::kRows == 64 && Cfg::kTokens == 64 && Cfg::kWarps == 8),
                "the wgmma phases are written for 64 rows x 64 keys and two warpgroups");
#else
  constexpr bool kUseWgmma = false;
  constexpr bool kUseWgmmaPV = false;
  constexpr bool kUseSeesaw = false;
  constexpr bool kUseSplitK = false;
#endif
  // The split combine (launched as a programmatic dependent of this grid) may start launching;
  // it waits for this grid's completion before it reads anything.
  if constexpr (kSeesaw) LaunchDependents();

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int b = blockIdx.z, split = blockIdx.y;
  const int m0 = blockIdx.x * kRows;

  const int kv_len = p.kv_lens[b];
  const int prefix = kv_len - p.draft;
  const int num_tiles = (kv_len + kTokens - 1) / kTokens;
  const int tile_begin = split * p.tiles_per_split;
  const int tile_end = min(num_tiles, tile_begin + p.tiles_per_split);
  if (tile_begin >= tile_end) return;  // a split past this request's (shorter) KV
  const int m_valid = min(kRows, p.rows - m0);
  const int64_t row0 = int64_t{b} * p.rows + m0;
  const int32_t* pages = p.kv_indices + p.kv_indptr[b];
  const int page_mask = (1 << p.page_shift) - 1;

  const uint32_t q_s = SmemAddress(smem + Cfg::kQOffset);
  const uint32_t kv_s = SmemAddress(smem + Cfg::kKvOffset);
  const uint32_t p_s = SmemAddress(smem + Cfg::kPOffset);
  uint32_t* p_words = reinterpret_cast<uint32_t*>(smem + Cfg::kPOffset);
  float* red = reinterpret_cast<float*>(smem + Cfg::kRedOffset);          // [2][kRows]
  float* row_scale = reinterpret_cast<float*>(smem + Cfg::kScaleOffset);  // [kRows]
  uint16_t* mask_s = reinterpret_cast<uint16_t*>(smem + Cfg::kMaskOffset);
  // wgmma's swizzle atoms need a 1024-byte aligned base (the dynamic shared memory base is in
  // practice); otherwise the ldmatrix Q·Kᵀ, which only needs the row-index swizzle, runs. The
  // wgmma P·V has no such fallback (its accumulator layout is its own).
  const bool use_wgmma = kUseWgmma && (q_s & 1023u) == 0;
  if (kUseWgmmaPV && !use_wgmma) __trap();

  LoadRows<Cfg, kRows>(q_s, tid, [&](int r, bool* valid) {
    *valid = r < m_valid;
    return p.q + (*valid ? (row0 + r) * kHeadDimQK : 0);
  });
  // Page ids of a tile's rows (rows past kv_len take the last key's page) go to page_ids[stage]
  // by cp.async in the commit group of the tile kStages - 1 earlier, so that issuing the tile's
  // row copies waits for a shared-memory read, not for a dependent global one. The first
  // kStages - 1 tiles read theirs from global memory.
  int32_t* page_ids = reinterpret_cast<int32_t*>(smem + Cfg::kPageIdOffset);  // [kStages][kTokens]
  auto prefetch_page_ids = [&](int tile, int stage) {
    if (tid < kTokens) {
      const int tt = min(tile * kTokens + tid, kv_len - 1);
      CpAsync4(SmemAddress(page_ids + stage * kTokens + tid), pages + (tt >> p.page_shift));
    }
  };
  auto load_tile = [&](int tile, int stage, bool ids_prefetched) {
    const int k0 = tile * kTokens;
    // The pool slot of the tile's row r (rows past kv_len: the last key's, zero-filled).
    auto slot_of = [&](int r, bool* valid) {
      const int t = k0 + r;
      *valid = t < kv_len;
      const int tt = *valid ? t : kv_len - 1;
      const int32_t page =
          ids_prefetched ? page_ids[stage * kTokens + r] : pages[tt >> p.page_shift];
      return (int64_t{page} << p.page_shift) + (tt & page_mask);
    };
    if constexpr (kE4m3) {
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(p.kv_pool);
      LoadRowsE4m3<Cfg, kTokens>(kv_s + stage * Cfg::kStageBytes, tid, [&](int r, bool* valid) {
        return codes + slot_of(r, valid) * kHeadDimQK;
      });
    } else {
      LoadRows<Cfg, kTokens>(kv_s + stage * Cfg::kStageBytes, tid, [&](int r, bool* valid) {
        return p.kv_pool + slot_of(r, valid) * kHeadDimQK;
      });
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (tile_begin + s < tile_end) load_tile(tile_begin + s, s, false);
    if (tile_begin + s + kStages - 1 < tile_end) {
      prefetch_page_ids(tile_begin + s + kStages - 1, (s + kStages - 1) % kStages);
    }
    CpAsyncCommit();
  }

  // S role: rows s_row + g and s_row + g + 8, keys s_key .. s_key + kTokens/2.
  const int s_group = warp % Cfg::kRowGroups, s_half = warp / Cfg::kRowGroups;
  const int s_row = s_group * 16, s_key = s_half * (kTokens / 2);
  // PV role: rows v_row .. v_row + 32, output dims v_dim .. v_dim + 128.
  const int v_pair = warp % Cfg::kRowPairs, v_quarter = warp / Cfg::kRowPairs;
  const int v_row = v_pair * 32, v_dim = v_quarter * 128;

  // Byte offsets of this lane's 16-byte chunk inside a 128-byte swizzle group, for the four
  // even chunk positions 2j (+1 for the lanes that read the upper 8 columns).
  const int x = lane & 7;
  uint32_t off_hi16[4], off_b[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    off_hi16[j] = ((2 * j + (lane >> 4)) ^ x) << 4;
    off_b[j] = ((2 * j + ((lane >> 3) & 1)) ^ x) << 4;
  }

  int tok_local[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = min(s_row + g + 8 * i, m_valid - 1);
    tok_local[i] = (m0 + r) / p.heads - m0 / p.heads;
  }
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  // 128 fp32 accumulators per thread. mma.sync PV: [m-tile 2][n-tile 16][4] of the PV role's
  // 32 rows x 128 dims. wgmma PV: [n-tile 32][4] of rows s_row + g (+8), dims 256 * s_half + ..
  float o_acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o_acc[i] = 0.f;

  const uint32_t a_base = q_s + (s_row + (lane & 15)) * 128;
  const int b_row =
      Cfg::kNTilesS % 2 == 0 ? s_key + (lane & 7) + ((lane >> 4) << 3) : s_key + (lane & 7);
  const int v_key = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int m_first = m0 / p.heads;

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int it = tile - tile_begin;
    const int stage = it % kStages;
    const int k0 = tile * kTokens;
    const bool tail = k0 + kTokens > prefix;
    if (tail) {
      // Visibility bits of this tile's keys for each token of the CTA's rows: prefix keys are
      // visible, tail keys per tree_mask, keys past kv_len not.
      for (int e = tid; e < kRows * Cfg::kMaskWords; e += Cfg::kThreads) {
        const int tl = e / Cfg::kMaskWords, w = e % Cfg::kMaskWords;
        const int tok = min(m_first + tl, p.draft - 1);
        const uint8_t* mrow = p.tree_mask + (int64_t{b} * p.draft + tok) * p.mask_row_bytes;
        uint32_t bits = 0;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
          const int j = k0 + w * 16 + k - prefix;
          bool vis = j < 0;
          if (j >= 0 && j < p.draft) {
            vis = p.mask_bits ? ((mrow[j >> 3] >> (j & 7)) & 1) != 0 : mrow[j] != 0;
          }
          bits |= uint32_t{vis} << k;
        }
        mask_s[e] = static_cast<uint16_t>(bits);
      }
    }
    CpAsyncWait<kStages - 2>();
    if (use_wgmma) FenceProxyAsyncShared();
    __syncthreads();  // tile `it` landed; everyone is done with the previous tile's buffers
    {
      // Tile `next`'s page ids came in tile `it`'s group (visible after the barrier); those of
      // tile next + kStages - 1 ride in next's group, into the buffer the previous iteration
      // read.
      const int next = tile + kStages - 1;
      if (next < tile_end) load_tile(next, (it + kStages - 1) % kStages, true);
      if (next + kStages - 1 < tile_end) {
        prefetch_page_ids(next + kStages - 1, (it + 2 * kStages - 2) % kStages);
      }
      CpAsyncCommit();
    }
    // e4m3: the next tile's codes are on their way; this one's are widened meanwhile.
    if constexpr (kE4m3) WidenE4m3Stage<Cfg>(smem + Cfg::kKvOffset + stage * Cfg::kStageBytes, tid);
    const uint32_t kv_tile = kv_s + stage * Cfg::kStageBytes;

    // ---- S = Q Kᵀ for 16 rows x kTokens/2 keys, all 576 dims.
    float s[Cfg::kNTilesS][4];
#pragma unroll
    for (int j = 0; j < Cfg::kNTilesS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
    if constexpr (kUseSplitK) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      // Warpgroup s_half: all 64 rows x all 64 keys over half of the 576 dims (k steps
      // [18 * s_half, +18)): m64n64k16, so each warpgroup reads half of Q and of K instead of
      // all of Q and half of K. The partial sums of the other warpgroup's 32 keys go to it
      // through shared memory: warpgroup 0's through the P tile (free until P is written),
      // warpgroup 1's through the tile's last 64-dim block (rope dims, which P·V does not read
      // and only warpgroup 1's k steps do).
      float acc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = 0.f;
      const uint64_t desc_a = SmemDescSw128(q_s);
      const uint64_t desc_b = SmemDescSw128(kv_tile);
      FenceOperands(acc);
      WgmmaFence();
#pragma unroll
      for (int k = 0; k < Cfg::kKSteps / 2; ++k) {
        const int kk = s_half * (Cfg::kKSteps / 2) + k;
        const uint64_t a_off = ((kk >> 2) * Cfg::kQBlockBytes + (kk & 3) * 32) >> 4;
        const uint64_t b_off = ((kk >> 2) * Cfg::kKvBlockBytes + (kk & 3) * 32) >> 4;
        WgmmaM64N64K16(acc, desc_a + a_off, desc_b + b_off);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceOperands(acc);
      float4* to_wg1 = reinterpret_cast<float4*>(smem + Cfg::kPOffset);
      float4* to_wg0 = reinterpret_cast<float4*>(smem + Cfg::kKvOffset + stage * Cfg::kStageBytes +
                                                 8 * Cfg::kKvBlockBytes);
      const int t = tid & 127;
      float4* out = s_half == 0 ? to_wg1 : to_wg0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // The other warpgroup's keys: 8-key tiles 4..7 for warpgroup 0, 0..3 for warpgroup 1.
        const int o0 = 4 * (4 + k), o1 = 4 * k;
        const float4 v0 = make_float4(acc[o0], acc[o0 + 1], acc[o0 + 2], acc[o0 + 3]);
        const float4 v1 = make_float4(acc[o1], acc[o1 + 1], acc[o1 + 2], acc[o1 + 3]);
        out[k * 128 + t] = s_half == 0 ? v0 : v1;
      }
      NamedBarrier(kBarSplitK, 2 * 128);
      const float4* in = s_half == 0 ? to_wg0 : to_wg1;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float4 v = in[k * 128 + t];
        const int m0 = 4 * k, m1 = 4 * (4 + k);
        s[k][0] = (s_half == 0 ? acc[m0] : acc[m1]) + v.x;
        s[k][1] = (s_half == 0 ? acc[m0 + 1] : acc[m1 + 1]) + v.y;
        s[k][2] = (s_half == 0 ? acc[m0 + 2] : acc[m1 + 2]) + v.z;
        s[k][3] = (s_half == 0 ? acc[m0 + 3] : acc[m1 + 3]) + v.w;
      }
#endif
    } else if (use_wgmma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      ScoresWgmma<Cfg, kTwoChainS ? 2 : 1>(s, q_s, kv_tile + s_key * 128);
#endif
    } else if (s_row < m_valid) {
      const uint32_t b_base = kv_tile + b_row * 128;
#pragma unroll
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
        const uint32_t qoff = (kk >> 2) * Cfg::kQBlockBytes;
        const uint32_t koff = (kk >> 2) * Cfg::kKvBlockBytes;
        uint32_t a[4];
        LdMatrixX4(a, a_base + qoff + off_hi16[kk & 3]);
        if constexpr (Cfg::kNTilesS % 2 == 0) {
#pragma unroll
          for (int jp = 0; jp < Cfg::kNTilesS / 2; ++jp) {
            uint32_t bb[4];
            LdMatrixX4(bb, b_base + jp * 16 * 128 + koff + off_b[kk & 3]);
            MmaBf16(s[2 * jp], a, bb[0], bb[1]);
            MmaBf16(s[2 * jp + 1], a, bb[2], bb[3]);
          }
        } else {
          uint32_t bb[2];
          LdMatrixX2(bb, b_base + koff + off_b[kk & 3]);
          MmaBf16(s[0], a, bb[0], bb[1]);
        }
      }
    }

    // ---- Online softmax (log2 domain). Masked keys become -inf.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < Cfg::kNTilesS; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ri = e >> 1;
        const int col = s_key + j * 8 + 2 * tq + (e & 1);
        float v = s[j][e] * p.scale_log2;
        if (tail) {
          const uint32_t w = mask_s[tok_local[ri] * Cfg::kMaskWords + (col >> 4)];
          if (((w >> (col & 15)) & 1u) == 0) v = -INFINITY;
        }
        s[j][e] = v;
        mx[ri] = fmaxf(mx[ri], v);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    if constexpr (kUseSeesaw) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      SeesawTile<Cfg>(s, mx, m_run, l_run, o_acc, s_half, s_row + g, s_key, tq, red, p_words, p_s,
                      kv_tile);
#endif
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (tq == 0) red[s_half * kRows + s_row + g + 8 * i] = mx[i];
      }
      NamedBarrier(1 + s_group, 64);
      float m_use[2], alpha[2], rowsum[2] = {0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float other = red[(1 - s_half) * kRows + s_row + g + 8 * i];
        const float m_new = fmaxf(m_run[i], fmaxf(mx[i], other));
        // A row with nothing visible yet keeps m = -inf; exp2(-inf - 0) = 0 keeps it NaN-free.
        m_use[i] = m_new == -INFINITY ? 0.f : m_new;
        alpha[i] = FastExp2(m_run[i] - m_use[i]);
        m_run[i] = m_new;
      }
#pragma unroll
      for (int j = 0; j < Cfg::kNTilesS; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = FastExp2(s[j][e] - m_use[e >> 1]);
          s[j][e] = pv;
          rowsum[e >> 1] += pv;
        }
        const int col = s_key + j * 8 + 2 * tq;
        if constexpr (kUseWgmmaPV) {
          // [64 rows, 128 bytes], 16-byte chunks swizzled by (row & 7): wgmma's K-major A.
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = s_row + g + 8 * hh;
            p_words[(r * 128 + (((col >> 3) ^ (r & 7)) << 4) + (col & 7) * 2) >> 2] =
                PackBf16x2(s[j][2 * hh], s[j][2 * hh + 1]);
          }
        } else {
          p_words[((s_row + g) * Cfg::kPStride + col) >> 1] = PackBf16x2(s[j][0], s[j][1]);
          p_words[((s_row + g + 8) * Cfg::kPStride + col) >> 1] = PackBf16x2(s[j][2], s[j][3]);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        l_run[i] = l_run[i] * alpha[i] + rowsum[i];
        if (!kUseWgmmaPV && s_half == 0 && tq == 0) row_scale[s_row + g + 8 * i] = alpha[i];
      }
      if constexpr (kUseWgmmaPV) FenceProxyAsyncShared();  // P is read by the async proxy next
      __syncthreads();  // P and the row scales are visible to the PV warps

      // ---- O = O * alpha + P V.
      if constexpr (kUseWgmmaPV) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // Warpgroup s_half: 64 rows x dims [256 * s_half, +256); this thread's rows are its S rows,
        // so alpha is already in registers.
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o_acc[4 * j] *= alpha[0];
          o_acc[4 * j + 1] *= alpha[0];
          o_acc[4 * j + 2] *= alpha[1];
          o_acc[4 * j + 3] *= alpha[1];
        }
        const uint64_t desc_p = SmemDescSw128(p_s);
        const uint64_t desc_v =
            SmemDescSw128MnMajor(kv_tile + s_half * 4 * Cfg::kKvBlockBytes, Cfg::kKvBlockBytes);
        FenceOperands(o_acc);
        WgmmaFence();
#pragma unroll
        for (int ks = 0; ks < kTokens / 16; ++ks) {
          // P: 16 more keys = 32 bytes along its rows; V: 16 more keys = 16 rows of 128 bytes.
          WgmmaM64N256K16TransB(o_acc, desc_p + ((ks * 32) >> 4), desc_v + ((ks * 16 * 128) >> 4));
        }
        WgmmaCommit();
        WgmmaWait<0>();
        FenceOperands(o_acc);
#endif
      } else if (v_row < m_valid) {
        // Rows v_row .. v_row + 32, dims v_dim .. v_dim + 128; o_acc[(mt * 16 + nt) * 4 + e].
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const float a0 = row_scale[v_row + mt * 16 + g];
          const float a1 = row_scale[v_row + mt * 16 + g + 8];
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) {
            o_acc[(mt * 16 + nt) * 4] *= a0;
            o_acc[(mt * 16 + nt) * 4 + 1] *= a0;
            o_acc[(mt * 16 + nt) * 4 + 2] *= a1;
            o_acc[(mt * 16 + nt) * 4 + 3] *= a1;
          }
        }
        const bool mt1 = v_row + 16 < m_valid;
#pragma unroll
        for (int ks = 0; ks < kTokens / 16; ++ks) {
          uint32_t pa[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            LdMatrixX4(pa[mt], p_s + ((v_row + mt * 16 + (lane & 15)) * Cfg::kPStride + ks * 16 +
                                      (lane >> 4) * 8) *
                                         2);
          }
          const uint32_t v_base =
              kv_tile + (ks * 16 + v_key) * 128 + (v_dim / 64) * Cfg::kKvBlockBytes;
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            uint32_t vb[4];
            LdMatrixX4Trans(vb, v_base + (np >> 2) * Cfg::kKvBlockBytes + off_hi16[np & 3]);
            MmaBf16At(o_acc, (2 * np) * 4, pa[0], vb[0], vb[1]);
            MmaBf16At(o_acc, (2 * np + 1) * 4, pa[0], vb[2], vb[3]);
            if (mt1) {
              MmaBf16At(o_acc, (16 + 2 * np) * 4, pa[1], vb[0], vb[1]);
              MmaBf16At(o_acc, (16 + 2 * np + 1) * 4, pa[1], vb[2], vb[3]);
            }
          }
        }
      }
    }  // v3 softmax and P·V
  }

  // ---- Epilogue: both key halves' row sums meet in shared memory; normalize, store.
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tq == 0) {
      red[s_half * kRows + s_row + g + 8 * i] = l;
      if (s_half == 0) row_scale[s_row + g + 8 * i] = m_run[i];
    }
  }
  __syncthreads();
  auto store_row = [&](int r, int dim0, int first_acc, int nt_stride, int num_nt, int half) {
    StoreOutputRow<kRows>(p, o_acc, red, row_scale, row0, split, tq, r, dim0, first_acc, nt_stride,
                          num_nt, half);
  };
  if constexpr (kUseWgmmaPV) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = s_row + g + 8 * hh;
      if (r < m_valid) store_row(r, 256 * s_half, 0, 4, 32, hh);
    }
  } else {
    if (v_row >= m_valid) return;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = v_row + mt * 16 + g + 8 * hh;
        if (r < m_valid) store_row(r, v_dim, mt * 64, 4, 16, hh);
      }
    }
  }
}

}  // namespace verifyd::kernels::custom
