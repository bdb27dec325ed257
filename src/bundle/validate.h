#pragma once
// Semantic validation of a bundle per the contract (README.md, "The computation"), after the
// tensors' dtypes and sizes are known to match the shape: kv_indptr, kv_indices, kv_lens, tree mask
// values, sm_scale.

#include "absl/status/status.h"
#include "src/bundle/bundle.h"

namespace verifyd {

// INVALID_ARGUMENT naming the field and the offending value/index, or OK. On OK fills
// v.max_kv_len and v.total_kv_len. Nothing reaches an engine without passing this.
absl::Status ValidateBundle(BundleView& v);

}  // namespace verifyd
