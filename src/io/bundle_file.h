#pragma once
// A verify bundle stored as a .safetensors file (golden cases, captures, `verifyctl replay`).
// Tensors: q BF16 [B*T, H, 576], kv_pool BF16 [num_pages, page_size, 576], kv_indptr I32 [B+1],
// kv_indices I32 [n], kv_lens I32 [B], tree_mask U8 [B, T, T], sm_scale F32 [1]; optional
// o_expected F32 [B*T, H, 512], lse_expected F32 [B*T, H]; any other tensors kept by name.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"
#include "src/io/safetensors.h"

namespace verifyd {

struct BundleFile {
  std::shared_ptr<const SafetensorsFile> file;  // owns every tensor `view` points into
  BundleView view;  // dtypes and shapes checked; not yet validated (run ValidateBundle)
  const Tensor* o_expected = nullptr;    // F32 [B*T, H, 512] when present
  const Tensor* lse_expected = nullptr;  // F32 [B*T, H] when present

  const Tensor* Find(const std::string& name) const { return file->Find(name); }
  const std::map<std::string, std::string>& metadata() const { return file->metadata; }
};

// NOT_FOUND / DATA_LOSS from reading the file; INVALID_ARGUMENT naming the tensor whose dtype or
// shape does not fit the bundle layout. tree_mask [B, T, ceil(T/8)] is read as bit-packed.
absl::StatusOr<BundleFile> LoadBundleFile(const std::string& path);
absl::StatusOr<BundleFile> BundleFileFromSafetensors(SafetensorsFile file, const std::string& what);

// Writes `v` in the layout above (a bit-packed mask is written as bytes, so that every reader
// sees [B, T, T]) plus `extra` tensors and `metadata`, atomically.
absl::Status SaveBundleFile(const std::string& path, const BundleView& v,
                            const std::vector<TensorRef>& extra = {},
                            const std::map<std::string, std::string>& metadata = {});

}  // namespace verifyd
