#pragma once
// Random bundles with a fixed seed, for tests, benchmarks and `verifyctl send`.

#include <cstdint>
#include <vector>

#include "src/bundle/bundle.h"

namespace verifyd {

enum class TreeKind { kChain, kRandomTree };

struct RandomBundleSpec {
  int batch = 1;
  int draft = 1;          // T
  int heads = 8;
  int page_size = 1;
  int64_t prefix = 0;                 // prefix length of every request...
  std::vector<int64_t> prefix_lens;   // ...unless this gives one per request
  TreeKind tree = TreeKind::kRandomTree;
  bool empty_row = false;  // request 0 gets prefix 0 and draft row T/2 sees nothing
  kernels::MaskFormat mask_format = kernels::MaskFormat::kBytes;
  float q_scale = 1.f;     // scales q (large logits)
  float sm_scale = 0.07216878364870322f;  // 1/sqrt(192)
  int extra_pages = 3;     // unused pages in the pool, NaN-poisoned
  uint64_t seed = 1;
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

  std::vector<uint16_t> q, kv_pool;
  std::vector<int32_t> kv_indptr, kv_indices, kv_lens;
  std::vector<uint8_t> tree_mask;

 private:
  RandomBundleSpec spec_;
  BundleView view_;
};

}  // namespace verifyd
