#pragma once
// The shadow tap's memory, shared by the tap kernel (tap_kernel.cu, in the serving stack's
// process) and verifyd (src/channel/tap_layout.h). Plain C++: nvcc and the host compilers
// both read it.
//
// The slots region (a device allocation the client registers with verifyd) holds a TapControl
// block in its first kTapControlBytes, then `slots` ring slots of TapSlotGeometry::slot_bytes:
//   q  bf16 [max_batch * T, H, 576]   the call's queries
//   o  bf16 [max_batch * T, H, 512]   the stack's own attention output
//   kv [max_pages, page_size, 576] of the pool's dtype (bf16, or e4m3: one byte an element)
//                                     the pages the call read, in kv_indices order
// each at a multiple of 256 bytes. The channel's request area holds one record per slot,
// record_bytes each, as int32 words:
//   [0] call   the tap call's number   [1] batch   [2] pages (kv_indptr[batch])
//   [3] flags  (kTapMalformed: the tap found a bad input and copied no tensor)
//   [4] kv_scale, the float's bits (an e4m3 pool's scale; 1 for bf16)
//   [5, 6 + max_batch)                 kv_indptr (the first batch + 1 used)
//   [6 + max_batch, 6 + 2 * max_batch) kv_lens   (the first batch used)
//   then the tree mask's bytes [max_batch, T, mask row bytes], the first batch used.
// The kv_indptr in a record indexes the slot's kv, whose page i is the call's kv_indices[i]:
// verifyd reads it with kv_indices 0, 1, ..., pages - 1.

#include <cstdint>

#ifdef __CUDACC__
#define VERIFYD_TAP_HD __host__ __device__
#else
#define VERIFYD_TAP_HD
#endif

namespace verifyd::tap {

inline constexpr uint64_t kTapControlBytes = 256;
inline constexpr uint64_t kTapAlign = 256;
inline constexpr uint32_t kTapDrop = 0xffffffffu;  // TapControl::decision: sampled, ring full
inline constexpr uint32_t kTapMalformed = 1u;      // record flags
inline constexpr uint32_t kTapRecordWords = 5;     // call, batch, pages, flags, kv_scale
inline constexpr uint32_t kTapRecordKvScale = 4;   // the word of kv_scale's bits
inline constexpr uint32_t kPpmAll = 1000000u;      // sample_ppm: every call

// Device memory, at the start of the slots region. verifyd writes the first line (its first 16
// bytes at once: TapVerifydWords), the tap kernel the second; neither writes the other's. The
// kernel reads each group of four words with one 16-byte load.
struct TapControl {
  uint32_t sample_ppm;  // verifyd: calls sampled per million
  uint32_t consumed;    // verifyd: ring fills it has finished with
  uint32_t verifyd_reserved[14];
  uint32_t decision;  // tap kernel, for its next call: 0 not sampled, kTapDrop, or slot + 1
  uint32_t calls;     // tap kernel: tap calls
  uint32_t produced;  // tap kernel: ring fills published
  uint32_t taps;      // tap kernel: sampled calls
  uint32_t dropped;   // tap kernel: sampled calls dropped, the ring being full
  uint32_t arrived;   // tap kernel: blocks of the current call that finished
  uint32_t bad;       // tap kernel: a page id past the pool was seen in the current call
  uint32_t tap_reserved[9];
};

// What verifyd writes into a TapControl, in one 16-byte piece at its start.
struct TapVerifydWords {
  uint32_t sample_ppm, consumed, zero[2];
};
static_assert(sizeof(TapControl) == 128, "TapControl is two 64-byte lines");

inline constexpr uint64_t TapAlignUp(uint64_t n) {
  return (n + kTapAlign - 1) / kTapAlign * kTapAlign;
}

struct TapSlotGeometry {
  uint64_t q_bytes = 0, o_bytes = 0, kv_bytes = 0;
  uint64_t o_offset = 0, kv_offset = 0;  // within a slot; q is at 0
  uint64_t slot_bytes = 0;
  uint64_t mask_row_bytes = 0;
  uint64_t record_bytes = 0;  // a multiple of 64
  // Where slot s starts in the slots region.
  uint64_t SlotOffset(uint32_t s) const { return kTapControlBytes + s * slot_bytes; }
};

// `bits_mask`: the tree mask is bit-packed ([B, T, ceil(T/8)]) rather than one byte per entry.
// `kv_elem_bytes`: 2 for a bf16 pool, 1 for e4m3.
inline TapSlotGeometry TapGeometry(uint64_t max_batch, uint64_t draft, uint64_t heads,
                                   uint64_t max_pages, uint64_t page_size, bool bits_mask,
                                   uint64_t kv_elem_bytes) {
  TapSlotGeometry g;
  const uint64_t rows = max_batch * draft;
  g.q_bytes = rows * heads * 576 * 2;
  g.o_bytes = rows * heads * 512 * 2;
  g.kv_bytes = max_pages * page_size * 576 * kv_elem_bytes;
  g.o_offset = TapAlignUp(g.q_bytes);
  g.kv_offset = g.o_offset + TapAlignUp(g.o_bytes);
  g.slot_bytes = g.kv_offset + TapAlignUp(g.kv_bytes);
  g.mask_row_bytes = bits_mask ? (draft + 7) / 8 : draft;
  const uint64_t words = kTapRecordWords + 2 * max_batch + 1;
  const uint64_t bytes = words * 4 + rows * g.mask_row_bytes;
  g.record_bytes = (bytes + 63) / 64 * 64;
  return g;
}

// Whether call number `call` is sampled at `ppm` calls per million: a hash of the number, so that
// the tap kernel and a test agree on which calls are taken.
VERIFYD_TAP_HD inline constexpr bool TapSampled(uint32_t call, uint32_t ppm) {
  if (ppm >= 1000000u) return true;
  uint32_t h = call * 2654435761u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h % 1000000u < ppm;
}

}  // namespace verifyd::tap
