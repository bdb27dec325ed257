#include "kernels/verify_problem.h"

#include <string>

namespace verifyd::kernels {
namespace {

std::string OutOfRange(const char* field, int64_t v, int64_t lo, int64_t hi) {
  return std::string(field) + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) +
         ", " + std::to_string(hi) + "]";
}

}  // namespace

std::string CheckShape(const ProblemShape& s) {
  if (s.batch < 1 || s.batch > kMaxBatch) return OutOfRange("batch", s.batch, 1, kMaxBatch);
  if (s.draft < 1 || s.draft > kMaxDraft) return OutOfRange("draft", s.draft, 1, kMaxDraft);
  if (s.heads < 1 || s.heads > kMaxHeads) return OutOfRange("heads", s.heads, 1, kMaxHeads);
  if (s.page_size < 1 || s.page_size > kMaxPageSize || (s.page_size & (s.page_size - 1)) != 0) {
    return "page_size: " + std::to_string(s.page_size) + " is not a power of two in [1, 128]";
  }
  if (s.num_pages < 1)
    return "kv_pool: needs at least one page, got " + std::to_string(s.num_pages);
  if (s.num_indices < 0) return "kv_indices: negative length " + std::to_string(s.num_indices);
  if (s.mask_format != MaskFormat::kBytes && s.mask_format != MaskFormat::kBits) {
    return "tree_mask: unknown mask format " + std::to_string(static_cast<int>(s.mask_format));
  }
  return "";
}

}  // namespace verifyd::kernels
