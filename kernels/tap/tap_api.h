#pragma once
// The tap kernel's C interface, exported by libverifyd_tap.so for the serving stack's process
// (clients/python/verifyd_client/tap.py loads it with ctypes and mirrors VerifydTapArgs; it
// checks the size against verifyd_tap_args_bytes()).

#include <stdint.h>

#include "kernels/tap/tap_abi.h"

extern "C" {

struct VerifydTapArgs {
  // Fixed when the tap channel is opened (OpenChannelResponse).
  void* control;       // device: the slots region's TapControl
  void* slots;         // device: slot 0 (the region's start + kTapControlBytes)
  void* records;       // device-visible pointer to record 0 (the channel's request area)
  void* header_words;  // device-visible pointer to the channel header's tap_produced (4 words)
  uint64_t slot_bytes, o_offset, kv_offset, record_bytes, mask_row_bytes;
  uint32_t slots_n, max_batch, draft, heads, max_pages, page_size;
  uint32_t kv_elem_bytes;  // 2: a bf16 pool, 1: e4m3
  // One layer's call: its pool's scale (1 for bf16), then the stack's tensors, contiguous, on
  // the device.
  float kv_scale;
  const void* q;        // bf16 [batch * T, H, 576]
  const void* o;        // bf16 [batch * T, H, 512]: the stack's output
  const void* kv_pool;  // [pool_pages, page_size, 576] of bf16 or e4m3 (kv_elem_bytes)
  uint64_t pool_pages;
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [kv_indptr[batch]]
  const int32_t* kv_lens;     // [batch]
  const uint8_t* mask;        // [batch, T, mask_row_bytes]
  uint32_t batch;
  uint32_t grid;  // blocks of 256 threads
};

// Launches one tap on `stream` (a cudaStream_t / CUstream). Returns a cudaError_t (0: launched).
int verifyd_tap_launch(const VerifydTapArgs* args, void* stream);
uint32_t verifyd_tap_args_bytes(void);
// TapGeometry (tap_abi.h) for a client sizing its slots region before it opens the channel:
// out[0..7] = slot_bytes, o_offset, kv_offset, record_bytes, mask_row_bytes, the first slot's
// offset, and the region's bytes for `slots` slots, then 0.
void verifyd_tap_geometry(uint32_t max_batch, uint32_t draft, uint32_t heads, uint32_t max_pages,
                          uint32_t page_size, int bits_mask, uint32_t kv_elem_bytes, uint32_t slots,
                          uint64_t out[8]);

}  // extern "C"
