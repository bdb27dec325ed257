// The shadow tap's kernel: one launch per tapped attention call, on the serving stack's stream
// (capturable in a CUDA graph). It never waits on verifyd. See tap_abi.h for the memory.
//
// Whether a call is sampled is decided at the end of the call before it, by that call's last
// block: every block of a call reads the same decision, which no block of the call changes
// before all have read it. An unsampled call reads one word per block, counts its arrival and
// returns; the last block counts the call and decides the next one. A sampled call copies q, the
// stack's o, the pages it read and its layout into the decided slot, and the last block
// publishes the fill (produced) after a system-wide fence, so that verifyd sees the slot whole.
//
// VERIFYD_TAP_COPY, set when the library is built, chooses how a sampled call is copied: the
// loads each thread keeps in flight. 4 (libverifyd_tap.so, the default) keeps four in flight with
// streaming loads and stores and copies the pages token by token: 0.28-0.34x the time of 1 on the
// H200 at 71634307b1ae. 1 (libverifyd_tap_one_load.so, the benchmark's baseline) copies one
// 16-byte vector at a time, the pages flattened into vectors.
// Both read nothing past the pool: a page id past it sets `bad` and the fill is malformed.

#include <cuda_runtime.h>

#include "kernels/tap/tap_api.h"

#ifndef VERIFYD_TAP_COPY
#define VERIFYD_TAP_COPY 4
#endif

namespace verifyd::tap {
namespace {

constexpr int kThreads = 256;
constexpr int kRowVecs = 576 * 2 / 16;  // 16-byte vectors in a row of 576 bf16 (q, a bf16 token)

// CopyVectors: n 16-byte vectors, thread `first` of `stride` taking every stride-th.
// CopyPages: the pages a call read; token t of the slot's kv is token t % page_size of page
// kv_indices[t / page_size] of the pool, a token being row_vecs 16-byte vectors (kRowVecs for
// bf16, half as many for e4m3). Both are spread over every thread of the grid.
#if VERIFYD_TAP_COPY == 1

__device__ void CopyVectors(uint4* dst, const uint4* src, uint64_t n, uint64_t first,
                            uint64_t stride) {
  for (uint64_t i = first; i < n; i += stride) dst[i] = src[i];
}

// Flattened into 16-byte vectors: vector v of the slot's kv is vector v % per_page of page
// kv_indices[v / per_page] of the pool.
__device__ void CopyPages(uint4* out, const uint4* pool, const int32_t* kv_indices, uint64_t pages,
                          uint32_t page_size, uint32_t row_vecs, uint64_t pool_pages,
                          uint32_t* bad) {
  const uint64_t first = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
  const uint64_t stride = uint64_t{gridDim.x} * kThreads;
  const uint64_t per_page = uint64_t{page_size} * row_vecs;
  for (uint64_t v = first; v < pages * per_page; v += stride) {
    const int32_t id = kv_indices[v / per_page];
    if (id < 0 || static_cast<uint64_t>(id) >= pool_pages) {
      *bad = 1;  // every thread that sees it writes the same value
      continue;
    }
    out[v] = pool[static_cast<uint64_t>(id) * per_page + v % per_page];
  }
}

#elif VERIFYD_TAP_COPY == 4

constexpr int kUnroll = 4;  // loads in flight per thread before their stores

// Streaming (evict-first) loads and stores: neither side is read again soon on this GPU.
__device__ void CopyVectors(uint4* __restrict__ dst, const uint4* __restrict__ src, uint64_t n,
                            uint64_t first, uint64_t stride) {
  uint64_t i = first;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = __ldcs(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) __stcs(dst + i + k * stride, v[k]);
  }
  for (; i < n; i += stride) __stcs(dst + i, __ldcs(src + i));
}

// Each warp copies kUnroll consecutive tokens at a time: one division per token rather than per
// vector, and a token's 72 vectors (bf16; 36 for e4m3) in at most three loads per lane.
__device__ void CopyPages(uint4* __restrict__ out, const uint4* __restrict__ pool,
                          const int32_t* kv_indices, uint64_t pages, uint32_t page_size,
                          uint32_t row_vecs, uint64_t pool_pages, uint32_t* bad) {
  const uint64_t tokens = pages * page_size;
  const uint32_t lane = threadIdx.x & 31;
  const uint64_t warp = (uint64_t{blockIdx.x} * kThreads + threadIdx.x) >> 5;
  const uint64_t warps = (uint64_t{gridDim.x} * kThreads) >> 5;
  for (uint64_t t0 = warp * kUnroll; t0 < tokens; t0 += warps * kUnroll) {
    const uint4* src[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t t = t0 + k;
      ok[k] = t < tokens;
      src[k] = pool;
      if (!ok[k]) continue;
      // 32-bit division: a slot's kv holds fewer than 2^32 tokens (2^32 x 1152 bytes would not
      // fit a GPU), and the 64-bit one spills on sm_120. The token within its page stays below
      // page_size and the page id is checked, so no truncation could read outside the pool.
      const uint32_t t32 = static_cast<uint32_t>(t);
      const int32_t id = kv_indices[t32 / page_size];
      if (id < 0 || static_cast<uint64_t>(id) >= pool_pages) {
        *bad = 1;  // every thread that sees it writes the same value
        ok[k] = false;
        continue;
      }
      src[k] = pool + (static_cast<uint64_t>(id) * page_size + t32 % page_size) * row_vecs;
    }
    uint4 v[kUnroll][3];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const uint32_t x = lane + 32 * j;
        if (ok[k] && x < row_vecs) v[k][j] = __ldcs(src[k] + x);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const uint32_t x = lane + 32 * j;
        if (ok[k] && x < row_vecs) __stcs(out + (t0 + k) * row_vecs + x, v[k][j]);
      }
    }
  }
}

#else
#error "VERIFYD_TAP_COPY: 1 (one load in flight per thread) or 4 (four)"
#endif

__global__ void __launch_bounds__(kThreads) TapKernel(VerifydTapArgs a) {
  auto* c = static_cast<TapControl*>(a.control);
  // decision, calls, produced, taps: written by the last block of the call before, unchanged
  // until every block of this call has arrived.
  const uint4 state = __ldcg(reinterpret_cast<const uint4*>(&c->decision));
  const uint32_t decision = state.x, call = state.y;
  const bool filling = decision != 0 && decision != kTapDrop;
  __shared__ bool valid;
  if (filling) {
    const uint32_t batch = a.batch;
    if (threadIdx.x == 0) {
      bool ok = batch >= 1 && batch <= a.max_batch && a.kv_indptr[0] == 0;
      for (uint32_t b = 0; ok && b < batch; ++b) ok = a.kv_indptr[b + 1] >= a.kv_indptr[b];
      valid = ok && static_cast<uint32_t>(a.kv_indptr[batch]) <= a.max_pages;
    }
    __syncthreads();
    const uint32_t slot = decision - 1;
    char* s = static_cast<char*>(a.slots) + uint64_t{slot} * a.slot_bytes;
    const uint64_t rows = uint64_t{batch} * a.draft;
    const uint64_t first = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
    const uint64_t stride = uint64_t{gridDim.x} * kThreads;
    int32_t* rec =
        reinterpret_cast<int32_t*>(static_cast<char*>(a.records) + uint64_t{slot} * a.record_bytes);
    if (valid) {
      CopyVectors(reinterpret_cast<uint4*>(s), static_cast<const uint4*>(a.q),
                  rows * a.heads * kRowVecs, first, stride);
      CopyVectors(reinterpret_cast<uint4*>(s + a.o_offset), static_cast<const uint4*>(a.o),
                  rows * a.heads * 512 * 2 / 16, first, stride);
      CopyPages(reinterpret_cast<uint4*>(s + a.kv_offset), static_cast<const uint4*>(a.kv_pool),
                a.kv_indices, static_cast<uint32_t>(a.kv_indptr[batch]), a.page_size,
                576 * a.kv_elem_bytes / 16, a.pool_pages, &c->bad);
      if (blockIdx.x == 0) {  // the layout, into the host record
        const uint32_t words = 2 * a.max_batch + 1;
        for (uint32_t i = threadIdx.x; i <= batch; i += kThreads) {
          rec[kTapRecordWords + i] = a.kv_indptr[i];
        }
        for (uint32_t i = threadIdx.x; i < batch; i += kThreads) {
          rec[kTapRecordWords + a.max_batch + 1 + i] = a.kv_lens[i];
        }
        auto* mask_out = reinterpret_cast<uint8_t*>(rec + kTapRecordWords + words);
        for (uint64_t i = threadIdx.x; i < rows * a.mask_row_bytes; i += kThreads) {
          mask_out[i] = a.mask[i];
        }
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      rec[0] = static_cast<int32_t>(call);
      rec[1] = static_cast<int32_t>(batch);
      rec[2] = valid ? a.kv_indptr[batch] : 0;
      rec[3] = valid ? 0 : static_cast<int32_t>(kTapMalformed);
      rec[kTapRecordKvScale] = __float_as_int(a.kv_scale);
    }
    __threadfence_system();  // this block's slot and record writes, before its arrival
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(&c->arrived, 1u) != gridDim.x - 1) return;
  // The last block of the call.
  __threadfence();
  c->arrived = 0;
  uint32_t produced = state.z, taps = state.w, dropped = c->dropped;
  if (decision == kTapDrop) {
    ++taps;
    c->dropped = ++dropped;
  } else if (filling) {
    ++taps;
    if (__ldcg(&c->bad) != 0) {
      c->bad = 0;
      auto* rec = reinterpret_cast<volatile int32_t*>(static_cast<char*>(a.records) +
                                                      uint64_t{decision - 1} * a.record_bytes);
      rec[3] = static_cast<int32_t>(kTapMalformed);
    }
    __threadfence_system();  // the slot and the record before the fill is published
    ++produced;
  }
  // The next call's decision, from verifyd's words (one load).
  const uint2 v = __ldcg(reinterpret_cast<const uint2*>(&c->sample_ppm));
  uint32_t next = 0;
  if (TapSampled(call + 1, v.x)) {
    next = produced - v.y >= a.slots_n ? kTapDrop : produced % a.slots_n + 1;
  }
  *reinterpret_cast<uint4*>(&c->decision) = make_uint4(next, call + 1, produced, taps);
  // The header's words: produced, calls, taps, dropped.
  *static_cast<uint4*>(a.header_words) = make_uint4(produced, call + 1, taps, dropped);
}

}  // namespace
}  // namespace verifyd::tap

extern "C" int verifyd_tap_launch(const VerifydTapArgs* args, void* stream) {
  if (args == nullptr || args->grid == 0 || args->slots_n == 0 ||
      (args->kv_elem_bytes != 1 && args->kv_elem_bytes != 2)) {
    return cudaErrorInvalidValue;
  }
  verifyd::tap::
      TapKernel<<<args->grid, verifyd::tap::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          *args);
  return static_cast<int>(cudaGetLastError());
}

extern "C" uint32_t verifyd_tap_args_bytes(void) { return sizeof(VerifydTapArgs); }

extern "C" void verifyd_tap_geometry(uint32_t max_batch, uint32_t draft, uint32_t heads,
                                     uint32_t max_pages, uint32_t page_size, int bits_mask,
                                     uint32_t kv_elem_bytes, uint32_t slots, uint64_t out[8]) {
  const verifyd::tap::TapSlotGeometry g = verifyd::tap::TapGeometry(
      max_batch, draft, heads, max_pages, page_size, bits_mask != 0, kv_elem_bytes);
  const uint64_t values[8] = {
      g.slot_bytes,     g.o_offset,      g.kv_offset,         g.record_bytes,
      g.mask_row_bytes, g.SlotOffset(0), g.SlotOffset(slots), 0};
  for (int i = 0; i < 8; ++i) out[i] = values[i];
}
