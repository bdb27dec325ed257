#pragma once
// A bundle rebuilt from another one's requests, for the invariance probes: the same tokens under
// another page size, another order of pages in the pool, another batch (requests picked, repeated
// or reordered), or another start of the draft block (the first s draft tokens made prefix).
// The attention of every row it keeps is the source row's, so the custom path must give the same
// output there, whatever it makes of the new geometry.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"

namespace verifyd {

struct RepackSpec {
  std::vector<int> requests;  // source requests, in the new batch's order; empty: all, in order
  int page_size = 0;          // 0: the source's
  uint64_t page_shuffle = 0;  // 0: pages in token order, request after request; else the seed of
                              // a permutation of the pool's pages
  int draft_shift = 0;        // s: draft tokens [0, s) become prefix; T' = T - s (s < T)
};

class RepackedBundle {
 public:
  // INVALID_ARGUMENT when the spec does not fit the source (request index, page size, shift).
  static absl::StatusOr<RepackedBundle> Make(const BundleView& src, const RepackSpec& spec);
  // Moves keep the view valid (a vector's move keeps its storage); copies would not.
  RepackedBundle(RepackedBundle&&) = default;
  RepackedBundle& operator=(RepackedBundle&&) = default;
  RepackedBundle(const RepackedBundle&) = delete;
  RepackedBundle& operator=(const RepackedBundle&) = delete;

  const BundleView& view() const { return view_; }
  // The source's (request, draft token) row of this bundle's draft token i of request b.
  int SourceRequest(int b) const { return requests_[b]; }
  int SourceToken(int i) const { return i + shift_; }
  // Whether row (b, i) sees the same keys as its source row: always without a shift; with one,
  // when the source row sees every draft token the shift made prefix.
  bool Comparable(int b, int i) const { return comparable_[int64_t{b} * view_.shape.draft + i]; }

 private:
  RepackedBundle() = default;
  void PointView();

  std::vector<int> requests_;
  int shift_ = 0;
  std::vector<bool> comparable_;
  std::vector<uint16_t> q_, kv_pool_;
  std::vector<int32_t> kv_indptr_, kv_indices_, kv_lens_;
  std::vector<uint8_t> tree_mask_;
  BundleView view_;
};

}  // namespace verifyd
