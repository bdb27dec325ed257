#pragma once
// What an e4m3 bundle's requests read, code by code: for the tests that check a bundle exercises
// the subnormal codes (kernels/e4m3.h) on purpose.

#include <cstdint>

#include "kernels/verify_problem.h"
#include "src/bundle/bundle.h"

namespace verifyd {

struct E4m3Codes {
  int64_t codes = 0;      // every element of every token the requests read
  int64_t subnormal = 0;  // exponent 0, mantissa not 0
  int64_t zero = 0;       // +0 and -0
  int64_t nan = 0;        // S.1111.111
};

// The codes of the KV rows `v`'s requests read (their kv_lens tokens), `v` holding an e4m3 pool.
inline E4m3Codes CountE4m3Codes(const BundleView& v) {
  E4m3Codes c;
  for (int b = 0; b < v.shape.batch; ++b) {
    for (int64_t t = 0; t < v.kv_lens[b]; ++t) {
      const uint8_t* row =
          static_cast<const uint8_t*>(v.kv_pool) + v.KvSlot(b, t) * kernels::kHeadDimQK;
      for (int d = 0; d < kernels::kHeadDimQK; ++d) {
        ++c.codes;
        c.subnormal += (row[d] & 0x78) == 0 && (row[d] & 7) != 0;
        c.zero += (row[d] & 0x7f) == 0;
        c.nan += (row[d] & 0x7f) == 0x7f;
      }
    }
  }
  return c;
}

}  // namespace verifyd
