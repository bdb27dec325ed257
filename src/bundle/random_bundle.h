#pragma once
// Random bundles with a fixed seed, for tests, benchmarks and `verifyctl send`.

#include <cstdint>
#include <string>
#include <vector>

#include "src/bundle/bundle.h"

namespace verifyd {

enum class TreeKind { kChain, kRandomTree };

// How queries relate to keys.
//   kRandom: q ~ N(0, q_scale^2) independent of K; attention is diffuse, each key carries about
//     1/kv_len of the weight and outputs shrink as the prefix grows.
//   kRealistic: attention concentrated the way served models concentrate it. Each (draft token,
//     head) query is a mix of chosen keys' K vectors, scaled so that their logits sit a few nats
//     above log(kv_len) and dominate the softmax: attention-sink tokens at the start of the
//     prefix, the most recent prefix tokens (recency bias), a few heavy-hitter positions per
//     head, and the draft token itself with its tree ancestors. q_scale is not applied.
enum class Traffic { kRandom, kRealistic };

// "random" / "realistic"; false for anything else.
bool ParseTraffic(const std::string& name, Traffic* out);
const char* TrafficName(Traffic t);

// 1/sqrt(192): the softmax scale of DeepSeek-V3's query-key head dims (128 nope + 64 rope)
// without its rope scaling; the default.
inline constexpr float kPlainSmScale = 0.07216878364870322f;
// DeepSeek-V3's (and Kimi K2's) real softmax scale: 1/sqrt(192) times the YaRN mscale squared,
// (0.1 * ln(40) + 1)^2 for its rope factor 40. A path that ignored the bundle's scale for
// 1/sqrt(192) would be exact at the default and wrong here.
inline constexpr float kDeepSeekV3SmScale = 0.1352337788608801f;

struct RandomBundleSpec {
  int batch = 1;
  int draft = 1;  // T
  int heads = 8;
  int page_size = 1;
  int64_t prefix = 0;                // prefix length of every request...
  std::vector<int64_t> prefix_lens;  // ...unless this gives one per request
  TreeKind tree = TreeKind::kRandomTree;
  Traffic traffic = Traffic::kRandom;
  bool empty_row = false;  // request 0 gets prefix 0 and draft row T/2 sees nothing
  kernels::MaskFormat mask_format = kernels::MaskFormat::kBytes;
  float q_scale = 1.f;  // scales q (large logits)
  float sm_scale = kPlainSmScale;
  int extra_pages = 3;  // unused pages in the pool, NaN-poisoned
  uint64_t seed = 1;
  // kE4m3: the pool quantised to e4m3 at kv_scale (each value v becomes e4m3(v / kv_scale); the
  // queries are drawn from the bf16 values first).
  kernels::KvDtype kv_dtype = kernels::KvDtype::kBf16;
  float kv_scale = 1.f;
};

// Owns the tensors; view() is already validated (max_kv_len/total_kv_len filled).
// Pages are shuffled across the pool; every slot no request uses holds NaN.
class RandomBundle {
 public:
  explicit RandomBundle(const RandomBundleSpec& spec);
  // view() points into the object's own vectors.
  RandomBundle(const RandomBundle&) = delete;
  RandomBundle& operator=(const RandomBundle&) = delete;
  const BundleView& view() const { return view_; }
  const RandomBundleSpec& spec() const { return spec_; }

  std::vector<uint16_t> q, kv_pool;   // kv_pool: the bf16 values, before any quantisation
  std::vector<uint8_t> kv_pool_e4m3;  // the pool view() names when spec.kv_dtype is kE4m3
  std::vector<int32_t> kv_indptr, kv_indices, kv_lens;
  std::vector<uint8_t> tree_mask;

 private:
  RandomBundleSpec spec_;
  BundleView view_;
};

}  // namespace verifyd
