#include "src/bundle/validate.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

absl::Status FinitePositive(const char* field, float x) {
  if (std::isfinite(x) && x > 0.f) return absl::OkStatus();
  return Bad(absl::StrCat(field, ": ", x, " must be finite and > 0"));
}

}  // namespace

absl::Status BadPageId(int64_t i, int64_t page, int64_t num_pages) {
  return Bad(absl::StrCat("kv_indices[", i, "]: page ", page, " is outside the pool's [0, ",
                          num_pages, ")"));
}

absl::Status BadMaskByte(const kernels::ProblemShape& s, int64_t at, uint8_t byte) {
  const int64_t row_bytes = kernels::MaskRowBytes(s.mask_format, s.draft);
  const int64_t r = at / row_bytes;
  const int64_t b = r / s.draft, i = r % s.draft;
  if (s.mask_format == kernels::MaskFormat::kBytes) {
    return Bad(absl::StrCat("tree_mask[", b, ",", i, ",", at % row_bytes, "]: ", int{byte},
                            " is not 0 or 1"));
  }
  return Bad(absl::StrCat("tree_mask[", b, ",", i, "]: bits past T are set in the bit-packed row"));
}

absl::Status ValidateBundle(BundleView& v) {
  if (std::string why = kernels::CheckShape(v.shape); !why.empty()) return Bad(why);
  const auto& s = v.shape;
  if (!v.q || !v.kv_pool || !v.kv_indptr || !v.kv_lens || !v.tree_mask ||
      (s.num_indices > 0 && !v.kv_indices)) {
    return Bad("bundle: a tensor is missing");
  }
  if (absl::Status st = FinitePositive("sm_scale", v.sm_scale); !st.ok()) return st;
  if (absl::Status st = FinitePositive("kv_scale", v.kv_scale); !st.ok()) return st;
  if (const float folded = v.sm_scale * v.kv_scale; !std::isfinite(folded) || folded <= 0.f) {
    // The paths scale the logits by both at once (DequantizedBundle).
    return Bad(absl::StrCat("kv_scale: ", v.kv_scale, " times sm_scale ", v.sm_scale,
                            " is not a finite positive float"));
  }
  if (s.kv_dtype == kernels::KvDtype::kBf16 && v.kv_scale != 1.f) {
    return Bad(absl::StrCat("kv_scale: ", v.kv_scale,
                            " is for an e4m3 pool; a bf16 kv_pool takes none (or 1)"));
  }
  if (v.kv_indptr[0] != 0) {
    return Bad(absl::StrCat("kv_indptr[0]: ", v.kv_indptr[0], " must be 0"));
  }
  for (int b = 0; b < s.batch; ++b) {
    if (v.kv_indptr[b + 1] < v.kv_indptr[b]) {
      return Bad(absl::StrCat("kv_indptr[", b + 1, "]: ", v.kv_indptr[b + 1], " < kv_indptr[", b,
                              "] = ", v.kv_indptr[b], " (must be non-decreasing)"));
    }
  }
  if (v.kv_indptr[s.batch] != s.num_indices) {
    return Bad(absl::StrCat("kv_indptr[", s.batch, "]: ", v.kv_indptr[s.batch],
                            " does not match the length of kv_indices (", s.num_indices, ")"));
  }
  // Page ids and mask bytes in device memory are checked there (BundleView::indices_device).
  const bool contents_here = v.indices_device < 0;
  for (int64_t i = 0; contents_here && i < s.num_indices; ++i) {
    if (v.kv_indices[i] < 0 || v.kv_indices[i] >= s.num_pages) {
      return BadPageId(i, v.kv_indices[i], s.num_pages);
    }
  }
  int64_t max_len = 0, total = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int64_t len = v.kv_lens[b];
    if (len < s.draft) {
      return Bad(absl::StrCat("kv_lens[", b, "]: ", len, " is less than the draft length T = ",
                              s.draft, " (kv_lens counts prefix + T)"));
    }
    if (len - s.draft > kernels::kMaxPrefix) {
      return Bad(absl::StrCat("kv_lens[", b, "]: prefix ", len - s.draft, " exceeds the limit ",
                              kernels::kMaxPrefix));
    }
    const int64_t pages_needed = (len + s.page_size - 1) / s.page_size;
    const int64_t pages_given = v.kv_indptr[b + 1] - v.kv_indptr[b];
    if (pages_given < pages_needed) {
      return Bad(absl::StrCat("kv_indptr: request ", b, " has ", pages_given, " pages but kv_lens[",
                              b, "] = ", len, " needs ", pages_needed, " of page_size ",
                              s.page_size));
    }
    max_len = std::max(max_len, len);
    total += len;
  }
  const int64_t row_bytes = kernels::MaskRowBytes(s.mask_format, s.draft);
  for (int64_t r = 0; contents_here && r < v.rows(); ++r) {
    const uint8_t* row = v.tree_mask + r * row_bytes;
    if (s.mask_format == kernels::MaskFormat::kBytes) {
      for (int j = 0; j < s.draft; ++j) {
        if (row[j] > 1) return BadMaskByte(s, r * row_bytes + j, row[j]);
      }
    } else if (s.draft % 8 != 0) {
      const uint8_t pad = static_cast<uint8_t>(0xffu << (s.draft % 8));
      if (row[row_bytes - 1] & pad) return BadMaskByte(s, r * row_bytes + row_bytes - 1, 0);
    }
  }
  v.max_kv_len = max_len;
  v.total_kv_len = total;
  return absl::OkStatus();
}

}  // namespace verifyd
