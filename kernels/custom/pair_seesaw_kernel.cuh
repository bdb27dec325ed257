#pragma once
// v5 of the fused kernel: the seesaw schedule at tile granularity, two KV tiles per step.
//
// Same grid, tiles and shared-memory size as the Hopper tiles of fused_verify_kernel.cuh (64 query
// rows per CTA, two 64-token KV buffers, Q resident), but each warpgroup owns one whole tile of a
// step: warpgroup 0 computes S0 = Q K0ᵀ of the tile in buffer 0, warpgroup 1 S1 = Q K1ᵀ of the one
// in buffer 1 (m64n64k16 over the 576 dims, so the row max of a tile needs no exchange). Output
// dims stay split: warpgroup 0 owns o_L = dims [0, 256), warpgroup 1 o_R = [256, 512). Per step,
// with m the running row max (the same in both warpgroups):
//   [0] m0 = max(m, rowmax S0); o_L = o_L 2^(m - m0) + P0(m0) V0_L     (P0 from registers)
//   [1] m1 = max(m0, rowmax S1); o_R = o_R 2^(m - m1) + P1(m1) V1_R    (P1 from registers)
//   [0] P0 (x 2^(m0 - m1)) to shared memory; o_L = o_L 2^(m0 - m1) + P1 V1_L
//   [1] o_R += P0 V0_R
// (FlashMLA's "seesaw"). The warpgroups hand m0, m1, P0 and P1 to each other through mbarriers,
// one way, so neither waits for the other's unrelated work, and their GEMMs take turns on the
// tensor cores while the other warpgroup runs its softmax.
//
// Loads are split by who reads what, so that each 64-dim block of a buffer is reloaded by the
// warpgroup that reads it last, as soon as it is done (no CTA-wide barrier in the loop):
//   buffer 0 blocks 0-3 (K0 and V0_L): read only by warpgroup 0; reloaded by it after o_L's P0 V0_L
//   buffer 0 blocks 4-8 (V0_R, rope; P0 goes into block 8 once S0 is done): warpgroup 1, after
//     P0 V0_R
//   buffer 1 blocks 4-7 (V1_R): read only by warpgroup 1; reloaded by it after P1 V1_R
//   buffer 1 blocks 0-3 and 8 (V1_L, rope, then P1): warpgroup 0, after P1 V1_L
// Each of these four loads signals its own mbarrier through cp.async.mbarrier.arrive; the
// reader's k steps of S visit first the blocks loaded earliest. Rows are gathered through
// kv_indices with 16-byte cp.async (any page size), rows past kv_len zero-filled; the page ids of a
// warpgroup's next load are read into registers at the start of the step before.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/custom/device_primitives.cuh"
#include "kernels/custom/fused_verify_kernel.cuh"  // LoadRows
#include "kernels/custom/kernel_checks.cuh"
#include "kernels/custom/kernel_epilogue.cuh"
#include "kernels/custom/kernel_params.h"
#include "kernels/custom/tile_config.cuh"

namespace verifyd::kernels::custom {

// Where v5 keeps its small state: in the Hopper tiles' P-tile area, which it does not use (each P
// lives in the rope block of its tile's buffer).
template <class Cfg>
struct PairSeesawLayout {
  static constexpr size_t kRed = Cfg::kPOffset;  // f32 [2][kRows]: m0, m1; then row sums
  static constexpr size_t kRowMax = kRed + 2 * Cfg::kRows * 4;  // f32 [kRows], the epilogue's
  static constexpr size_t kBars = kRowMax + Cfg::kRows * 4;     // kNumBars mbarriers
  enum Bar { kFull0Lo, kFull0Hi, kFull1Lo, kFull1Hi, kM0, kM1, kP0, kP1, kS0, kNumBars };
  static constexpr size_t kMaskRows = kBars + kNumBars * 8;  // i64 [kRows]: v5t's mask rows
  static_assert(kBars % 8 == 0 && kMaskRows + Cfg::kRows * 8 <= Cfg::kSmemBytes, "v5 state fits");
};

// Phase stamps for bench/kernel_trace.cu, compiled in only with VERIFYD_KERNEL_TRACE: CTA
// (0, 0, 0)'s first thread of each warpgroup writes clock64() at the phase boundaries of its
// first kTraceSteps steps into g_kernel_trace[warpgroup][step][event].
inline constexpr int kTraceSteps = 64;
inline constexpr int kTraceEvents = 12;
#if defined(VERIFYD_KERNEL_TRACE)
__device__ uint64_t* g_kernel_trace = nullptr;
#define VERIFYD_TRACE(step, ev)                                                                \
  do {                                                                                         \
    if (g_kernel_trace != nullptr && (blockIdx.x | blockIdx.y | blockIdx.z) == 0 && wt == 0 && \
        (step) < kTraceSteps) {                                                                \
      g_kernel_trace[(wg * kTraceSteps + (step)) * kTraceEvents + (ev)] = clock64();           \
    }                                                                                          \
  } while (0)
#else
#define VERIFYD_TRACE(step, ev) \
  do {                          \
  } while (0)
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Issues this warpgroup's cp.async for the 64-dim blocks in `blocks` (a bit per block) of tile
// `tile`'s 64 rows into `buf`; pid[pass] is the page of row 16 * pass + wt / 8 (clamped to the last
// key), loaded beforehand. Thread wt of 128 copies 16-byte chunk wt % 8 of four rows. A page id
// outside the pool is read as page 0 and reported (kernel_checks.cuh), here where the address
// needs it: a test where the id is loaded would wait for the load there, a step early.
template <class Cfg>
__device__ __forceinline__ void LoadTileBlocks(const KernelParams& p, uint32_t buf, int tile,
                                               int kv_len, int page_mask, uint32_t blocks,
                                               const int32_t (&pid)[4], int wt) {
  const int sub = wt & 7;
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int r = pass * 16 + (wt >> 3);
    const int t = tile * Cfg::kTokens + r;
    const bool valid = t < kv_len;
    const int tt = valid ? t : kv_len - 1;
    const int32_t page = CheckedPage(p, pid[pass]);
    const uint16_t* src =
        p.kv_pool + ((int64_t{page} << p.page_shift) + (tt & page_mask)) * kHeadDimQK;
    const uint32_t dst = buf + r * 128 + ((sub ^ (r & 7)) << 4);
#pragma unroll
    for (int kb = 0; kb < Cfg::kChunksPerRow / 8; ++kb) {
      if ((blocks >> kb) & 1u) {
        CpAsync16(dst + kb * Cfg::kKvBlockBytes, src + kb * 64 + sub * 8, valid);
      }
    }
  }
}

// The page ids of the four rows this thread loads of tile `tile` (rows past kv_len: the last
// key's), as stored: read a step before LoadTileBlocks uses (and checks) them, and not waited for
// until then.
template <class Cfg>
__device__ __forceinline__ void LoadPageIds(const KernelParams& p, const int32_t* pages, int tile,
                                            int kv_len, int wt, int32_t (&pid)[4]) {
#pragma unroll
  for (int pass = 0; pass < 4; ++pass) {
    const int t = min(tile * Cfg::kTokens + pass * 16 + (wt >> 3), kv_len - 1);
    pid[pass] = pages[t >> p.page_shift];
  }
}

// Issues S += Q Kᵀ k steps [kk0, kk1) of one whole 64-key tile (wgmma m64n64k16, both operands in
// shared memory); the caller fences and commits.
template <class Cfg>
__device__ __forceinline__ void ScoreSteps(float (&acc)[32], uint32_t q_s, uint32_t kv_tile,
                                           int kk0, int kk1) {
  const uint64_t desc_a = SmemDescSw128(q_s);
  const uint64_t desc_b = SmemDescSw128(kv_tile);
#pragma unroll
  for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
    if (kk < kk0 || kk >= kk1) continue;
    const uint64_t a_off = ((kk >> 2) * Cfg::kQBlockBytes + (kk & 3) * 32) >> 4;
    const uint64_t b_off = ((kk >> 2) * Cfg::kKvBlockBytes + (kk & 3) * 32) >> 4;
    WgmmaM64N64K16(acc, desc_a + a_off, desc_b + b_off);
  }
}

// P (this thread's rows row, row + 8 x keys 8j + 2tq (+1), j < 8) as the A fragments of the four
// K = 16 steps of a register-A wgmma.
__device__ __forceinline__ void PackP64(const float (&pv)[32], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    a[ks][0] = PackBf16x2(pv[8 * ks], pv[8 * ks + 1]);
    a[ks][1] = PackBf16x2(pv[8 * ks + 2], pv[8 * ks + 3]);
    a[ks][2] = PackBf16x2(pv[8 * ks + 4], pv[8 * ks + 5]);
    a[ks][3] = PackBf16x2(pv[8 * ks + 6], pv[8 * ks + 7]);
  }
}

// The same P times `f` per row, into the 128-byte-swizzled [64 rows, 64 keys] tile at p_words that
// wgmma reads as a K-major A operand.
__device__ __forceinline__ void StoreP64(const float (&pv)[32], const float (&f)[2], int row,
                                         int tq, uint32_t* p_words) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = j * 8 + 2 * tq;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row + 8 * hh;
      p_words[(r * 128 + ((j ^ (r & 7)) << 4) + (col & 7) * 2) >> 2] =
          PackBf16x2(pv[4 * j + 2 * hh] * f[hh], pv[4 * j + 2 * hh + 1] * f[hh]);
    }
  }
}

// V of a KV buffer as the MN-major B operand of P V: dims [256 * half, +256), 64 keys.
template <class Cfg>
__device__ __forceinline__ uint64_t VDesc(uint32_t kv_tile, int half) {
  return SmemDescSw128MnMajor(kv_tile + half * 4 * Cfg::kKvBlockBytes, Cfg::kKvBlockBytes);
}

// o (this warpgroup's 64 rows x 256 dims) += P V over a 64-key tile, four K = 16 steps; V the dims
// [256 * half, +256) of the KV buffer at kv_tile. P from registers (a: PackP64's fragments) or from
// the swizzled P tile at p_tile. The caller fences and commits.
template <class Cfg>
__device__ __forceinline__ void PvFromRegisters(float (&o)[128], const uint32_t (&a)[4][4],
                                                uint32_t kv_tile, int half) {
  const uint64_t dv = VDesc<Cfg>(kv_tile, half);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    WgmmaM64N256K16RegATransB(o, a[ks], dv + ((ks * 16 * 128) >> 4));
  }
}
template <class Cfg>
__device__ __forceinline__ void PvFromShared(float (&o)[128], uint32_t p_tile, uint32_t kv_tile,
                                             int half) {
  const uint64_t dp = SmemDescSw128(p_tile);
  const uint64_t dv = VDesc<Cfg>(kv_tile, half);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    WgmmaM64N256K16TransB(o, dp + ((ks * 32) >> 4), dv + ((ks * 16 * 128) >> 4));
  }
}
#endif

// kStagger (v5s): warpgroup 1 issues S1 only once warpgroup 0's S0 has completed, so that the two
// Q·Kᵀ take turns on the tensor cores and S1 runs under warpgroup 0's softmax (without it both
// start together, each at half the shared-memory bandwidth, and then both run softmax while the
// tensor cores idle: bench/kernel_trace.cu).
// kTailMask (v5t): the steps whose two tiles hold only prefix keys run a copy of the step compiled
// without the tree mask (no mask predicates, no mask pointers live); the steps from the first
// tile that reaches the draft keys on run the masked copy. Without it every step is the masked
// copy, which tests per tile whether the tile reaches the draft keys.
template <class Cfg, bool kStagger, bool kTailMask = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) PairSeesawKernel(const KernelParams p) {
  if (SkipLaunch(p)) return;  // uniform: before any barrier
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Cfg::kRows == 64 && Cfg::kTokens == 64 && Cfg::kThreads == 256,
                "v5 is written for 64 rows x 64 keys and two warpgroups");
  using L = PairSeesawLayout<Cfg>;
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kRows = Cfg::kRows, kTokens = Cfg::kTokens;
  constexpr uint32_t kLo = 0x0Fu;       // blocks 0-3
  constexpr uint32_t kLoRope = 0x10Fu;  // blocks 0-3 and 8
  constexpr uint32_t kHi = 0xF0u;       // blocks 4-7
  constexpr uint32_t kHiRope = 0x1F0u;  // blocks 4-8
  // The split combine (a programmatic dependent) may start launching.
  LaunchDependents();

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, wt = tid & 127;
  const int g = lane >> 2, tq = lane & 3;
  const int row = ((tid >> 5) & 3) * 16 + g;  // this thread's rows: row, row + 8
  const int b = blockIdx.z, split = blockIdx.y;
  const int m0 = blockIdx.x * kRows;
  // The op's checks (kernel_checks.cuh; no-ops without): the last CTA to finish (unsplit), or the
  // combine's last block, writes the call's verdict. Each early return below is uniform over the
  // CTA.
  if (NotServing(p)) return FinishCtaEarly(p, kVerdictNotServing, p.splits == 1);

  const int kv_len = p.kv_lens[b];
  const unsigned layout = LayoutVerdict(p, b, kv_len);
  if (layout != 0) return FinishCtaEarly(p, layout, p.splits == 1);  // nothing read through it
  const int prefix = kv_len - p.draft;
  const int num_tiles = (kv_len + kTokens - 1) / kTokens;
  const int tile_begin = split * p.tiles_per_split;
  const int tile_end = min(num_tiles, tile_begin + p.tiles_per_split);
  // A split past this request's (shorter) KV.
  if (tile_begin >= tile_end) return FinishCtaEarly(p, 0u, p.splits == 1);
  const int m_valid = min(kRows, p.rows - m0);
  const int64_t row0 = int64_t{b} * p.rows + m0;
  const int32_t* pages = p.kv_indices + p.kv_indptr[b];
  const int page_mask = (1 << p.page_shift) - 1;

  const uint32_t q_s = SmemAddress(smem + Cfg::kQOffset);
  const uint32_t buf0 = SmemAddress(smem + Cfg::kKvOffset);
  const uint32_t buf1 = buf0 + Cfg::kStageBytes;
  const uint32_t p0_s = buf0 + 8 * Cfg::kKvBlockBytes;  // P0 in buffer 0's rope block
  const uint32_t p1_s = buf1 + 8 * Cfg::kKvBlockBytes;
  uint32_t* p0_words = reinterpret_cast<uint32_t*>(smem + Cfg::kKvOffset + 8 * Cfg::kKvBlockBytes);
  uint32_t* p1_words = reinterpret_cast<uint32_t*>(smem + Cfg::kKvOffset + Cfg::kStageBytes +
                                                   8 * Cfg::kKvBlockBytes);
  float* red = reinterpret_cast<float*>(smem + L::kRed);
  float* row_max = reinterpret_cast<float*>(smem + L::kRowMax);
  const uint32_t bars = SmemAddress(smem + L::kBars);
  auto bar = [&](int i) { return bars + 8u * static_cast<uint32_t>(i); };
  if ((q_s & 1023u) != 0) __trap();  // wgmma's swizzle atoms need 1024-byte alignment

  if (tid == 0) {
    for (int i = 0; i < L::kNumBars; ++i) MbarInit(bar(i), 128);
  }
  // v5t: the offset of each row's tree-mask row (rows past m_valid take the last valid one's), read
  // from shared memory on masked tiles only, so that no register holds it through the prefix steps.
  int64_t* mask_rows = reinterpret_cast<int64_t*>(smem + L::kMaskRows);
  if (kTailMask && tid < kRows) {
    const int mtok = (m0 + min(tid, m_valid - 1)) / p.heads;
    mask_rows[tid] = (int64_t{b} * p.draft + mtok) * p.mask_row_bytes;
  }
  __syncthreads();

  LoadRows<Cfg, kRows>(q_s, tid, [&](int r, bool* valid) {
    *valid = r < m_valid;
    return p.q + (*valid ? (row0 + r) * kHeadDimQK : 0);
  });
  CpAsyncCommit();
  // The first step's tiles, each warpgroup its share.
  {
    int32_t pid[4];
    const int t0 = tile_begin, t1 = tile_begin + 1;
    LoadPageIds<Cfg>(p, pages, t0, kv_len, wt, pid);
    LoadTileBlocks<Cfg>(p, buf0, t0, kv_len, page_mask, wg == 0 ? kLo : kHiRope, pid, wt);
    CpAsyncMbarArrive(bar(wg == 0 ? L::kFull0Lo : L::kFull0Hi));
    if (t1 < tile_end) {
      LoadPageIds<Cfg>(p, pages, t1, kv_len, wt, pid);
      LoadTileBlocks<Cfg>(p, buf1, t1, kv_len, page_mask, wg == 0 ? kLoRope : kHi, pid, wt);
      CpAsyncMbarArrive(bar(wg == 0 ? L::kFull1Lo : L::kFull1Hi));
    }
    CpAsyncCommit();
  }
  // The first split's CTAs check their rows of the mask while the first loads are in flight.
  if (ChecksOn(p) && split == 0) CheckMaskRows(p, b, m0, m_valid);
  CpAsyncWait<1>();  // Q
  FenceProxyAsyncShared();
  __syncthreads();

  // Tree-mask rows of this thread's two query rows (rows past m_valid take the last valid one):
  // v5 keeps them in registers through the whole loop; v5t reads them from mask_rows on masked
  // tiles.
  const uint8_t* mrow_kept[2] = {nullptr, nullptr};
  if constexpr (!kTailMask) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int mtok = (m0 + min(row + 8 * i, m_valid - 1)) / p.heads;
      mrow_kept[i] = p.tree_mask + (int64_t{b} * p.draft + mtok) * p.mask_row_bytes;
    }
  }
  // Scores of one tile in the log2 domain, masked keys -inf (kMasked: for a tile that reaches the
  // draft keys), and their row maxima.
  auto softmax_input = [&](auto masked, float(&s)[32], int tile, float(&mx)[2]) {
    constexpr bool kMasked = decltype(masked)::value;
    const int k0 = tile * kTokens;
    const bool tail = kMasked && k0 + kTokens > prefix;
    const uint8_t* mrow[2] = {mrow_kept[0], mrow_kept[1]};
    if constexpr (kTailMask) {
      if (tail) {
        mrow[0] = p.tree_mask + mask_rows[row];
        mrow[1] = p.tree_mask + mask_rows[row + 8];
      }
    }
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ri = e >> 1;
        float v = s[4 * j + e] * p.scale_log2;
        if (tail) {
          const int jj = k0 + j * 8 + 2 * tq + (e & 1) - prefix;
          bool vis = jj < 0;
          if (jj >= 0 && jj < p.draft) {
            vis = p.mask_bits ? ((mrow[ri][jj >> 3] >> (jj & 7)) & 1) != 0 : mrow[ri][jj] != 0;
          }
          if (!vis) v = -INFINITY;
        }
        s[4 * j + e] = v;
        mx[ri] = fmaxf(mx[ri], v);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
  };
  auto scale_o = [&](float(&o)[128], const float(&f)[2]) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j] *= f[0];
      o[4 * j + 1] *= f[0];
      o[4 * j + 2] *= f[1];
      o[4 * j + 3] *= f[1];
    }
  };

  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  float o_acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o_acc[i] = 0.f;

  // One step: tiles t0 (warpgroup 0) and t0 + 1 (warpgroup 1), masked as `masked` says.
  auto run_step = [&](auto masked, int step, int t0) {
    const uint32_t par = static_cast<uint32_t>(step & 1);
    const int t1 = t0 + 1, n0 = t0 + 2, n1 = t0 + 3;
    const bool has1 = t1 < tile_end, has_n0 = n0 < tile_end, has_n1 = n1 < tile_end;
    // Page ids of this warpgroup's loads at the end of the step, read now.
    int32_t pid_n0[4], pid_n1[4];
    if (has_n0) LoadPageIds<Cfg>(p, pages, n0, kv_len, wt, pid_n0);
    if (has_n1) LoadPageIds<Cfg>(p, pages, n1, kv_len, wt, pid_n1);
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    float mx[2], m_new[2], m_use[2], f[2], rowsum[2] = {0.f, 0.f};
    uint32_t a[4][4];
    VERIFYD_TRACE(step, 0);
    if (wg == 0) {
      // S0 over buffer 0: blocks 0-3 (this warpgroup's load) first.
      MbarWait(bar(L::kFull0Lo), par);
      VERIFYD_TRACE(step, 1);
      FenceProxyAsyncShared();
      FenceOperands(s);
      WgmmaFence();
      ScoreSteps<Cfg>(s, q_s, buf0, 0, 16);
      MbarWait(bar(L::kFull0Hi), par);
      VERIFYD_TRACE(step, 2);
      FenceProxyAsyncShared();
      WgmmaFence();
      ScoreSteps<Cfg>(s, q_s, buf0, 16, Cfg::kKSteps);
      WgmmaCommit();
      WgmmaWait<0>();
      FenceOperands(s);
      if (kStagger) MbarArrive(bar(L::kS0));
      VERIFYD_TRACE(step, 3);
      softmax_input(masked, s, t0, mx);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_new[i] = fmaxf(m_run[i], mx[i]);  // m0
        m_use[i] = m_new[i] == -INFINITY ? 0.f : m_new[i];
        f[i] = FastExp2(m_run[i] - m_use[i]);
        if (tq == 0) red[row + 8 * i] = m_new[i];
      }
      MbarArrive(bar(L::kM0));
      VERIFYD_TRACE(step, 4);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        s[i] = FastExp2(s[i] - m_use[(i >> 1) & 1]);
        rowsum[(i >> 1) & 1] += s[i];
      }
      PackP64(s, a);
#pragma unroll
      for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * f[i] + rowsum[i];
      scale_o(o_acc, f);
      FenceOperands(o_acc);
      WgmmaFence();
      PvFromRegisters<Cfg>(o_acc, a, buf0, 0);
      WgmmaCommit();
      VERIFYD_TRACE(step, 5);
      // m1 from warpgroup 1: P0 rescaled to it goes to buffer 0's rope block for o_R.
      MbarWait(bar(L::kM1), par);
      VERIFYD_TRACE(step, 6);
      float m1[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m1[i] = red[kRows + row + 8 * i];
        const float m1_use = m1[i] == -INFINITY ? 0.f : m1[i];
        f[i] = FastExp2(m_new[i] - m1_use);
        l_run[i] *= f[i];
      }
      StoreP64(s, f, row, tq, p0_words);
      FenceProxyAsyncShared();
      MbarArrive(bar(L::kP0));
      VERIFYD_TRACE(step, 7);
      WgmmaWait<0>();  // P0 V0_L: buffer 0 blocks 0-3 are free, and a[]
      FenceOperands(o_acc);
      VERIFYD_TRACE(step, 8);
      if (has_n0) {
        LoadTileBlocks<Cfg>(p, buf0, n0, kv_len, page_mask, kLo, pid_n0, wt);
        CpAsyncMbarArrive(bar(L::kFull0Lo));
      }
      scale_o(o_acc, f);
      if (has1) {
        MbarWait(bar(L::kP1), par);
        VERIFYD_TRACE(step, 9);
        FenceProxyAsyncShared();
        FenceOperands(o_acc);
        WgmmaFence();
        PvFromShared<Cfg>(o_acc, p1_s, buf1, 0);
        WgmmaCommit();
        WgmmaWait<0>();  // P1 V1_L: buffer 1 blocks 0-3 and 8 are free
        FenceOperands(o_acc);
        VERIFYD_TRACE(step, 10);
      }
      if (has_n1) {
        LoadTileBlocks<Cfg>(p, buf1, n1, kv_len, page_mask, kLoRope, pid_n1, wt);
        CpAsyncMbarArrive(bar(L::kFull1Lo));
      }
      VERIFYD_TRACE(step, 11);
#pragma unroll
      for (int i = 0; i < 2; ++i) m_run[i] = m1[i];
    } else {
      if (has1) {
        // S1 over buffer 1: blocks 4-7 (this warpgroup's load) first.
        MbarWait(bar(L::kFull1Hi), par);
        if (kStagger) MbarWait(bar(L::kS0), par);
        VERIFYD_TRACE(step, 1);
        FenceProxyAsyncShared();
        FenceOperands(s);
        WgmmaFence();
        ScoreSteps<Cfg>(s, q_s, buf1, 16, 32);
        MbarWait(bar(L::kFull1Lo), par);
        VERIFYD_TRACE(step, 2);
        FenceProxyAsyncShared();
        WgmmaFence();
        ScoreSteps<Cfg>(s, q_s, buf1, 0, 16);
        ScoreSteps<Cfg>(s, q_s, buf1, 32, Cfg::kKSteps);
        WgmmaCommit();
        WgmmaWait<0>();
        FenceOperands(s);
        VERIFYD_TRACE(step, 3);
        softmax_input(masked, s, t1, mx);
      } else {
        mx[0] = mx[1] = -INFINITY;
      }
      MbarWait(bar(L::kM0), par);
      VERIFYD_TRACE(step, 4);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_new[i] = fmaxf(red[row + 8 * i], mx[i]);  // m1
        m_use[i] = m_new[i] == -INFINITY ? 0.f : m_new[i];
        f[i] = FastExp2(m_run[i] - m_use[i]);
        if (tq == 0) red[kRows + row + 8 * i] = m_new[i];
      }
      MbarArrive(bar(L::kM1));
      VERIFYD_TRACE(step, 5);
      if (has1) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          s[i] = FastExp2(s[i] - m_use[(i >> 1) & 1]);
          rowsum[(i >> 1) & 1] += s[i];
        }
        const float one[2] = {1.f, 1.f};
        StoreP64(s, one, row, tq, p1_words);
        FenceProxyAsyncShared();
      }
      MbarArrive(bar(L::kP1));
      VERIFYD_TRACE(step, 6);
#pragma unroll
      for (int i = 0; i < 2; ++i) l_run[i] = l_run[i] * f[i] + rowsum[i];
      scale_o(o_acc, f);
      if (has1) {
        PackP64(s, a);
        FenceOperands(o_acc);
        WgmmaFence();
        PvFromRegisters<Cfg>(o_acc, a, buf1, 1);
        WgmmaCommit();
      }
      VERIFYD_TRACE(step, 7);
      MbarWait(bar(L::kP0), par);
      VERIFYD_TRACE(step, 8);
      FenceProxyAsyncShared();
      FenceOperands(o_acc);
      WgmmaFence();
      PvFromShared<Cfg>(o_acc, p0_s, buf0, 1);
      WgmmaCommit();
      if (has1) {
        WgmmaWait<1>();  // P1 V1_R: buffer 1 blocks 4-7 are free, and a[]
        if (has_n1) {
          LoadTileBlocks<Cfg>(p, buf1, n1, kv_len, page_mask, kHi, pid_n1, wt);
          CpAsyncMbarArrive(bar(L::kFull1Hi));
        }
      }
      VERIFYD_TRACE(step, 9);
      WgmmaWait<0>();  // P0 V0_R: buffer 0 blocks 4-8 are free
      FenceOperands(o_acc);
      VERIFYD_TRACE(step, 10);
      if (has_n0) {
        LoadTileBlocks<Cfg>(p, buf0, n0, kv_len, page_mask, kHiRope, pid_n0, wt);
        CpAsyncMbarArrive(bar(L::kFull0Hi));
      }
      VERIFYD_TRACE(step, 11);
#pragma unroll
      for (int i = 0; i < 2; ++i) m_run[i] = m_new[i];
    }
  };
  // v5t: the steps whose two tiles hold prefix keys only (tiles before prefix / kTokens) run the
  // copy without the mask.
  // v5t: the steps whose two tiles hold prefix keys only (the tiles before prefix / kTokens) run
  // the copy without the mask, the rest the masked copy.
  const int prefix_tiles = kTailMask ? min(tile_end, prefix / kTokens) : tile_begin;
  int step = 0, t0 = tile_begin;
#pragma unroll 1
  for (; t0 + 2 <= prefix_tiles; ++step, t0 += 2) run_step(std::false_type{}, step, t0);
#pragma unroll 1
  for (; t0 < tile_end; ++step, t0 += 2) run_step(std::true_type{}, step, t0);

  // ---- Epilogue: the two warpgroups' row sums meet in shared memory; normalize, store.
  __syncthreads();  // both warpgroups are past their last read of red (m0, m1)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tq == 0) {
      red[wg * kRows + row + 8 * i] = l;
      if (wg == 0) row_max[row + 8 * i] = m_run[i];
    }
  }
  __syncthreads();
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row + 8 * hh;
    if (r < m_valid &&
        StoreOutputRow<kRows>(p, o_acc, red, row_max, row0, split, tq, r, 256 * wg, 0, 4, 32, hh)) {
      Report(p, kVerdictNonFinite);
    }
  }
  FinishCta(p, p.splits == 1);
#else
  (void)p;
  __trap();  // launched only on sm_90a devices
#endif
}

}  // namespace verifyd::kernels::custom
