#include "src/bundle/bundle.h"

#include <algorithm>
#include <cstring>

namespace verifyd {

// q's and the pool's bf16 values are copied as bytes: inline bytes read in place
// (ParseRequestInPlace) may start at any address, where a uint16_t load is undefined.
OwnedBundle::OwnedBundle(const BundleView& v)
    : q_(static_cast<size_t>(v.q_elems())),
      kv_indptr_(v.kv_indptr, v.kv_indptr + v.shape.batch + 1),
      kv_indices_(v.kv_indices, v.kv_indices + v.shape.num_indices),
      kv_lens_(v.kv_lens, v.kv_lens + v.shape.batch),
      tree_mask_(v.tree_mask, v.tree_mask + v.mask_bytes()),
      view_(v) {
  std::memcpy(q_.data(), v.q, q_.size() * 2);
  if (v.kv_pool_shared) {
    const int64_t page_bytes = v.page_bytes();
    kv_pool_.resize(static_cast<size_t>(v.shape.num_indices * page_bytes));
    for (int64_t i = 0; i < v.shape.num_indices; ++i) {
      std::memcpy(kv_pool_.data() + i * page_bytes,
                  static_cast<const uint8_t*>(v.kv_pool) + v.kv_indices[i] * page_bytes,
                  static_cast<size_t>(page_bytes));
      kv_indices_[i] = static_cast<int32_t>(i);
    }
    view_.shape.num_pages = v.shape.num_indices;
    view_.kv_pool_shared = false;
  } else {
    kv_pool_.resize(static_cast<size_t>(v.kv_bytes()));
    std::memcpy(kv_pool_.data(), v.kv_pool, kv_pool_.size());
  }
  PointViewAtStorage();
}

int64_t OwnedBundle::BytesFor(const BundleView& v) {
  const int64_t pool_bytes = v.kv_pool_shared ? v.shape.num_indices * v.page_bytes() : v.kv_bytes();
  return v.q_elems() * 2 + pool_bytes + (int64_t{v.shape.batch} * 2 + 1 + v.shape.num_indices) * 4 +
         v.mask_bytes();
}

OwnedBundle::OwnedBundle(const BundleView& v, Sized)
    : q_(v.q_elems()),
      kv_pool_(v.kv_bytes()),
      kv_indptr_(v.shape.batch + 1),
      kv_indices_(v.shape.num_indices),
      kv_lens_(v.shape.batch),
      tree_mask_(v.mask_bytes()),
      view_(v) {
  PointViewAtStorage();
}

void OwnedBundle::PointViewAtStorage() {
  view_.q = q_.data();
  view_.kv_pool = kv_pool_.data();
  view_.kv_indptr = kv_indptr_.data();
  view_.kv_indices = kv_indices_.data();
  view_.kv_lens = kv_lens_.data();
  view_.tree_mask = tree_mask_.data();
}

}  // namespace verifyd
