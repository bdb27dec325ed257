#pragma once
// Whether a path puts an e4m3 pool's kv_scale on o before o's one rounding to bf16, or on the
// rounded o (a second rounding). With q = 0 every row weighs its keys equally; with 64 keys
// (T = 1 after a prefix of 63) each weight is 1/64, exact in bf16 and fp32, so o is the scaled
// mean of 64 V rows, which fp32 computes all but exactly. Rounded once, o is then the oracle's
// answer rounded to bf16 in nearly every element; the scale put on the rounded mean misses it
// in a large share of them.

#include <cstdint>
#include <vector>

#include "src/bundle/random_bundle.h"
#include "src/common/bf16.h"

namespace verifyd {

inline RandomBundleSpec EqualWeightsE4m3Spec(float kv_scale, int page_size, uint64_t seed) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 1;
  s.heads = 16;
  s.page_size = page_size;
  s.prefix = 63;
  s.traffic = Traffic::kRandom;
  s.q_scale = 0.f;  // every logit 0: every key weighs 1/64
  s.kv_dtype = kernels::KvDtype::kE4m3;
  s.kv_scale = kv_scale;
  s.seed = seed;
  return s;
}

// The share of o's elements equal to the oracle's (fp32) o rounded once to bf16.
inline double ShareRoundedOnce(const std::vector<uint16_t>& o, const std::vector<float>& oracle) {
  int64_t same = 0;
  for (size_t i = 0; i < o.size(); ++i) same += o[i] == FloatToBf16(oracle[i]);
  return o.empty() ? 0.0 : static_cast<double>(same) / static_cast<double>(o.size());
}

// The same share for the o a path makes that scales its rounded unscaled o: the test's check
// that this bundle tells the two apart.
inline double ShareIfRoundedTwice(const std::vector<float>& oracle, float kv_scale) {
  std::vector<uint16_t> twice(oracle.size());
  for (size_t i = 0; i < oracle.size(); ++i) {
    twice[i] = FloatToBf16(RoundToBf16(oracle[i] / kv_scale) * kv_scale);
  }
  return ShareRoundedOnce(twice, oracle);
}

}  // namespace verifyd
