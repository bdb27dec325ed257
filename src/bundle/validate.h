#pragma once
// Semantic validation of a bundle per the contract (README.md, "The computation"), after the
// tensors' dtypes and sizes are known to match the shape: kv_indptr, kv_indices, kv_lens, tree mask
// values, sm_scale, kv_scale. Page ids and mask bytes in a GPU's memory are the engine's to check
// there (BundleView::indices_device).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "src/bundle/bundle.h"

namespace verifyd {

// INVALID_ARGUMENT naming the field and the offending value/index, or OK. On OK fills
// v.max_kv_len and v.total_kv_len. Nothing reaches an engine without passing this.
absl::Status ValidateBundle(BundleView& v);

// The errors for a bad entry of kv_indices (at position i) or of tree_mask (its byte at
// position `at`, counted from the tensor's start), wherever it was found.
absl::Status BadPageId(int64_t i, int64_t page, int64_t num_pages);
absl::Status BadMaskByte(const kernels::ProblemShape& s, int64_t at, uint8_t byte);

}  // namespace verifyd
