#include "src/io/bundle_file.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

absl::Status Bad(const std::string& what, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
}

// The tensor `name` with dtype `dtype` and `rank` dimensions; null and an error otherwise.
absl::StatusOr<const Tensor*> Get(const SafetensorsFile& f, const std::string& what,
                                  const std::string& name, DType dtype, size_t rank,
                                  bool optional = false) {
  const Tensor* t = f.Find(name);
  if (t == nullptr) {
    if (optional) return nullptr;
    return Bad(what, absl::StrCat("tensor '", name, "' is missing"));
  }
  if (t->dtype != dtype) {
    return Bad(
        what, absl::StrCat(name, ": dtype ", DTypeName(t->dtype), ", expected ", DTypeName(dtype)));
  }
  if (t->shape.size() != rank) {
    return Bad(what, absl::StrCat(name, ": shape ", ShapeString(t->shape), " should have ", rank,
                                  " dimensions"));
  }
  return t;
}

// The scalar `name`: an F32 tensor of one element, rank 0 or 1; null when absent and `optional`.
absl::StatusOr<const Tensor*> ScalarF32(const SafetensorsFile& f, const std::string& what,
                                        const std::string& name, bool optional = false) {
  const Tensor* t = f.Find(name);
  if (t == nullptr) {
    if (optional) return nullptr;
    return Bad(what, absl::StrCat("tensor '", name, "' is missing"));
  }
  if (t->dtype != DType::kF32 || t->numel() != 1 || t->shape.size() > 1) {
    return Bad(what, absl::StrCat(name, ": ", DTypeName(t->dtype), " ", ShapeString(t->shape),
                                  ", expected F32 [1]"));
  }
  return t;
}

absl::Status ExpectShape(const std::string& what, const char* name, const Tensor& t,
                         const std::vector<int64_t>& want) {
  if (t.shape != want) {
    return Bad(what, absl::StrCat(name, ": shape ", ShapeString(t.shape), ", expected ",
                                  ShapeString(want)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BundleFile> BundleFileFromSafetensors(SafetensorsFile f, const std::string& what) {
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* q, Get(f, what, "q", DType::kBF16, 3));
  // The pool is bf16, or e4m3 with its scale in the tensor kv_scale (F32 [1]).
  const Tensor* pool_any = f.Find("kv_pool");
  const bool e4m3 = pool_any != nullptr && pool_any->dtype == DType::kF8E4M3;
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* kv_pool,
                           Get(f, what, "kv_pool", e4m3 ? DType::kF8E4M3 : DType::kBF16, 3));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* kv_indptr, Get(f, what, "kv_indptr", DType::kI32, 1));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* kv_indices, Get(f, what, "kv_indices", DType::kI32, 1));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* kv_lens, Get(f, what, "kv_lens", DType::kI32, 1));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* tree_mask, Get(f, what, "tree_mask", DType::kU8, 3));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* sm_scale, ScalarF32(f, what, "sm_scale"));
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* kv_scale,
                           ScalarF32(f, what, "kv_scale", /*optional=*/true));

  const int64_t B = kv_lens->shape[0];
  const int64_t T = tree_mask->shape[1];
  const int64_t rows = q->shape[0];
  const int64_t H = q->shape[1];
  if (q->shape[2] != kHeadDimQK) return ExpectShape(what, "q", *q, {rows, H, kHeadDimQK});
  if (kv_pool->shape[2] != kHeadDimQK) {
    return ExpectShape(what, "kv_pool", *kv_pool,
                       {kv_pool->shape[0], kv_pool->shape[1], kHeadDimQK});
  }
  if (B < 1 || B > kernels::kMaxBatch) {
    return Bad(what,
               absl::StrCat("kv_lens: batch ", B, " is outside [1, ", kernels::kMaxBatch, "]"));
  }
  if (T < 1 || T > kernels::kMaxDraft) {
    return Bad(what,
               absl::StrCat("tree_mask: draft ", T, " is outside [1, ", kernels::kMaxDraft, "]"));
  }
  if (H < 1 || H > kernels::kMaxHeads) {
    return Bad(what, absl::StrCat("q: heads ", H, " is outside [1, ", kernels::kMaxHeads, "]"));
  }
  VERIFYD_RETURN_IF_ERROR(ExpectShape(what, "q", *q, {B * T, H, kHeadDimQK}));
  VERIFYD_RETURN_IF_ERROR(ExpectShape(what, "kv_indptr", *kv_indptr, {B + 1}));
  kernels::MaskFormat mask_format;
  if (tree_mask->shape == std::vector<int64_t>{B, T, T}) {
    mask_format = kernels::MaskFormat::kBytes;
  } else if (tree_mask->shape == std::vector<int64_t>{B, T, (T + 7) / 8}) {
    mask_format = kernels::MaskFormat::kBits;
  } else {
    return ExpectShape(what, "tree_mask", *tree_mask, {B, T, T});
  }

  BundleFile out;
  BundleView& v = out.view;
  v.shape.batch = static_cast<int>(B);
  v.shape.draft = static_cast<int>(T);
  v.shape.heads = static_cast<int>(H);
  v.shape.page_size = static_cast<int>(kv_pool->shape[1]);
  v.shape.num_pages = kv_pool->shape[0];
  v.shape.num_indices = kv_indices->shape[0];
  v.shape.mask_format = mask_format;
  v.shape.kv_dtype = e4m3 ? kernels::KvDtype::kE4m3 : kernels::KvDtype::kBf16;
  v.q = q->as<uint16_t>();
  v.kv_pool = kv_pool->data.data();
  if (kv_scale != nullptr) v.kv_scale = *kv_scale->as<float>();
  v.kv_indptr = kv_indptr->as<int32_t>();
  v.kv_indices = kv_indices->as<int32_t>();
  v.kv_lens = kv_lens->as<int32_t>();
  v.tree_mask = tree_mask->as<uint8_t>();
  v.sm_scale = *sm_scale->as<float>();

  VERIFYD_ASSIGN_OR_RETURN(const Tensor* o_expected,
                           Get(f, what, "o_expected", DType::kF32, 3, /*optional=*/true));
  if (o_expected != nullptr) {
    VERIFYD_RETURN_IF_ERROR(ExpectShape(what, "o_expected", *o_expected, {B * T, H, kHeadDimV}));
  }
  VERIFYD_ASSIGN_OR_RETURN(const Tensor* lse_expected,
                           Get(f, what, "lse_expected", DType::kF32, 2, /*optional=*/true));
  if (lse_expected != nullptr) {
    VERIFYD_RETURN_IF_ERROR(ExpectShape(what, "lse_expected", *lse_expected, {B * T, H}));
  }
  out.o_expected = o_expected;
  out.lse_expected = lse_expected;
  // std::map nodes and vector buffers keep their addresses when the file moves into shared_ptr.
  out.file = std::make_shared<const SafetensorsFile>(std::move(f));
  return out;
}

absl::StatusOr<BundleFile> LoadBundleFile(const std::string& path) {
  auto file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  return BundleFileFromSafetensors(*std::move(file), path);
}

absl::Status SaveBundleFile(const std::string& path, const BundleView& v,
                            const std::vector<TensorRef>& extra,
                            const std::map<std::string, std::string>& metadata) {
  const auto& s = v.shape;
  const int64_t B = s.batch, T = s.draft, H = s.heads;
  std::vector<uint8_t> mask(B * T * T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < T; ++i) {
      for (int64_t j = 0; j < T; ++j) {
        mask[(b * T + i) * T + j] =
            v.MaskBit(static_cast<int>(b), static_cast<int>(i), static_cast<int>(j));
      }
    }
  }
  const float sm_scale = v.sm_scale, kv_scale = v.kv_scale;
  const bool e4m3 = s.kv_dtype == kernels::KvDtype::kE4m3;
  std::vector<TensorRef> tensors = {
      {"q", DType::kBF16, {B * T, H, kHeadDimQK}, v.q},
      {"kv_pool",
       e4m3 ? DType::kF8E4M3 : DType::kBF16,
       {s.num_pages, s.page_size, kHeadDimQK},
       v.kv_pool},
      {"kv_indptr", DType::kI32, {B + 1}, v.kv_indptr},
      {"kv_indices", DType::kI32, {s.num_indices}, v.kv_indices},
      {"kv_lens", DType::kI32, {B}, v.kv_lens},
      {"tree_mask", DType::kU8, {B, T, T}, mask.data()},
      {"sm_scale", DType::kF32, {1}, &sm_scale},
  };
  if (e4m3) tensors.push_back({"kv_scale", DType::kF32, {1}, &kv_scale});
  tensors.insert(tensors.end(), extra.begin(), extra.end());
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("B", std::to_string(B));
  meta.emplace("T", std::to_string(T));
  meta.emplace("H", std::to_string(H));
  meta.emplace("page_size", std::to_string(s.page_size));
  if (s.mask_format == kernels::MaskFormat::kBits) meta.emplace("mask_format_received", "bits");
  return WriteSafetensors(path, tensors, meta);
}

}  // namespace verifyd
