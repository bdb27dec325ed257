#pragma once
// The in-process op's checks of a call's inputs, as predicates shared by the two places that make
// them: the op's check kernel (kernels/op/verify_op.cu, CheckCall) and the shipped kernel's own
// checks (kernels/custom/kernel_checks.cuh). tests/cpu/test_call_checks.cc holds them to the
// contract (kernels/op/verify_op_api.h).

#include <cstdint>

#include "kernels/host_device.h"

namespace verifyd::kernels {

// Request b's layout is bad: kv_indptr must rise from 0 within max_indices (lo, hi: kv_indptr[b]
// and kv_indptr[b + 1]), and its kv_len lie in [T, min(max_kv_len, its pages x page_size)].
VERIFYD_HOST_DEVICE inline bool RequestLayoutBad(int b, int64_t lo, int64_t hi, int64_t kv_len,
                                                 int64_t max_indices, int64_t draft,
                                                 int64_t max_kv_len, int64_t page_size) {
  return (b == 0 && lo != 0) || hi < lo || hi > max_indices || kv_len < draft ||
         kv_len > max_kv_len || kv_len > (hi - lo) * page_size;
}

// A pool's bound on page ids for PageIdBad: its page count, as ids are int32 at most 2^31.
VERIFYD_HOST_DEVICE inline uint32_t PageIdLimit(int64_t pages) {
  return pages <= 0 ? 0u
                    : (pages < (int64_t{1} << 31) ? static_cast<uint32_t>(pages) : 0x80000000u);
}

// A page id outside the pool of PageIdLimit `limit`: one unsigned compare (a negative id wraps
// past any limit), which the kernel makes for every row it loads.
VERIFYD_HOST_DEVICE inline bool PageIdBad(int32_t page, uint32_t limit) {
  return static_cast<uint32_t>(page) >= limit;
}

// One byte of a tree-mask row is bad: a byte mask holds 0 or 1; a bit-packed row sets no bit past
// T in its last byte (`last_of_row`).
VERIFYD_HOST_DEVICE inline bool MaskByteBad(unsigned byte, bool bits, int draft, bool last_of_row) {
  if (!bits) return byte > 1;
  const int tail = draft & 7;
  return last_of_row && tail != 0 && (byte >> tail) != 0;
}

// Whether one of the two bf16 packed in `w` is a NaN or an Inf (all exponent bits set): the
// finite-output check of a stored pair.
VERIFYD_HOST_DEVICE inline bool NonFiniteBf16Pair(uint32_t w) {
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

}  // namespace verifyd::kernels
