#include "src/probe/repacked_bundle.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/bundle/validate.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;
using kernels::MaskFormat;

constexpr uint16_t kBf16Nan = 0x7fc0;  // every pool slot no request uses: a read shows

void SetMaskBit(MaskFormat f, uint8_t* row, int j) {
  if (f == MaskFormat::kBytes) {
    row[j] = 1;
  } else {
    row[j >> 3] |= static_cast<uint8_t>(1u << (j & 7));
  }
}

absl::Status CheckSpec(const BundleView& src, const RepackSpec& spec) {
  const int B = src.shape.batch, T = src.shape.draft;
  for (int r : spec.requests) {
    if (r < 0 || r >= B) return absl::InvalidArgumentError(absl::StrCat("request ", r));
  }
  const int page = spec.page_size;
  if (page != 0 && (page < 1 || page > 128 || (page & (page - 1)) != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("page_size ", page));
  }
  if (spec.draft_shift < 0 || spec.draft_shift >= T) {
    return absl::InvalidArgumentError(absl::StrCat("draft_shift ", spec.draft_shift));
  }
  if (!src.on_host()) return absl::InvalidArgumentError("the source is not in host memory");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RepackedBundle> RepackedBundle::Make(const BundleView& src, const RepackSpec& spec) {
  if (absl::Status st = CheckSpec(src, spec); !st.ok()) return st;
  RepackedBundle r;
  r.requests_ = spec.requests;
  if (r.requests_.empty()) {
    r.requests_.resize(src.shape.batch);
    std::iota(r.requests_.begin(), r.requests_.end(), 0);
  }
  r.shift_ = spec.draft_shift;
  const int B = static_cast<int>(r.requests_.size()), T_src = src.shape.draft;
  const int T = T_src - r.shift_, H = src.shape.heads;
  const int page = spec.page_size > 0 ? spec.page_size : src.shape.page_size;
  const MaskFormat fmt = src.shape.mask_format;
  const int64_t row_bytes = kernels::MaskRowBytes(fmt, T);
  const int64_t q_row = int64_t{H} * kHeadDimQK;

  BundleView& v = r.view_;
  v.shape = src.shape;
  v.shape.batch = B;
  v.shape.draft = T;
  v.shape.page_size = page;
  v.sm_scale = src.sm_scale;
  r.kv_indptr_.assign(B + 1, 0);
  r.kv_lens_.resize(B);
  for (int b = 0; b < B; ++b) {
    r.kv_lens_[b] = src.kv_lens[r.requests_[b]];
    r.kv_indptr_[b + 1] = r.kv_indptr_[b] + (r.kv_lens_[b] + page - 1) / page;
  }
  const int64_t pages = r.kv_indptr_[B];
  const int64_t num_pages = pages + 1;  // one page no request uses
  v.shape.num_pages = num_pages;
  v.shape.num_indices = pages;
  // Physical page of each logical page: in order, or a seeded permutation of the pool.
  std::vector<int32_t> slot(num_pages);
  std::iota(slot.begin(), slot.end(), 0);
  if (spec.page_shuffle != 0) {
    std::mt19937_64 rng(spec.page_shuffle);
    std::shuffle(slot.begin(), slot.end(), rng);
  }
  r.kv_indices_.assign(slot.begin(), slot.begin() + pages);
  r.kv_pool_.assign(num_pages * page * kHeadDimQK, kBf16Nan);
  r.q_.resize(int64_t{B} * T * q_row);
  r.tree_mask_.assign(int64_t{B} * T * row_bytes, 0);
  r.comparable_.assign(int64_t{B} * T, true);
  for (int b = 0; b < B; ++b) {
    const int s = r.requests_[b];
    for (int64_t t = 0; t < r.kv_lens_[b]; ++t) {
      const int64_t phys = r.kv_indices_[r.kv_indptr_[b] + t / page];
      std::memcpy(r.kv_pool_.data() + (phys * page + t % page) * kHeadDimQK, src.KvRow(s, t),
                  kHeadDimQK * 2);
    }
    for (int i = 0; i < T; ++i) {
      const int si = i + r.shift_;
      std::memcpy(r.q_.data() + (int64_t{b} * T + i) * q_row,
                  src.q + (int64_t{s} * T_src + si) * q_row, static_cast<size_t>(q_row) * 2);
      uint8_t* row = r.tree_mask_.data() + (int64_t{b} * T + i) * row_bytes;
      for (int j = 0; j < T; ++j) {
        if (src.MaskBit(s, si, j + r.shift_)) SetMaskBit(fmt, row, j);
      }
      bool sees_shifted = true;
      for (int j = 0; j < r.shift_; ++j) sees_shifted = sees_shifted && src.MaskBit(s, si, j);
      r.comparable_[int64_t{b} * T + i] = sees_shifted;
    }
  }
  r.PointView();
  if (absl::Status st = ValidateBundle(r.view_); !st.ok()) return st;
  return r;
}

void RepackedBundle::PointView() {
  view_.q = q_.data();
  view_.kv_pool = kv_pool_.data();
  view_.kv_indptr = kv_indptr_.data();
  view_.kv_indices = kv_indices_.data();
  view_.kv_lens = kv_lens_.data();
  view_.tree_mask = tree_mask_.data();
}

}  // namespace verifyd
