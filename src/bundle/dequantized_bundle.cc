#include "src/bundle/dequantized_bundle.h"

#include "kernels/e4m3.h"
#include "src/common/bf16.h"

namespace verifyd {

namespace {

// Elements of one page, and of the bf16 copy of the pages `v` names.
int64_t PageElems(const BundleView& v) { return int64_t{v.shape.page_size} * kernels::kHeadDimQK; }
int64_t CopyElems(const BundleView& v) { return v.shape.num_indices * PageElems(v); }

}  // namespace

int64_t DequantizedBundle::BytesFor(const BundleView& v) {
  return CopyElems(v) * 2 + v.shape.num_indices * 4;
}

DequantizedBundle::DequantizedBundle(const BundleView& v)
    : pool_(static_cast<size_t>(CopyElems(v))),
      indices_(static_cast<size_t>(v.shape.num_indices)),
      view_(v) {
  uint16_t table[256];  // every e4m3 value is exact in bf16
  for (int x = 0; x < 256; ++x)
    table[x] = FloatToBf16(kernels::E4m3ToFloat(static_cast<uint8_t>(x)));
  const int64_t page_elems = PageElems(v);
  const auto* src = static_cast<const uint8_t*>(v.kv_pool);
  for (int64_t i = 0; i < v.shape.num_indices; ++i) {
    const uint8_t* page = src + v.kv_indices[i] * page_elems;
    uint16_t* dst = pool_.data() + i * page_elems;
    for (int64_t k = 0; k < page_elems; ++k) dst[k] = table[page[k]];
    indices_[i] = static_cast<int32_t>(i);
  }
  view_.kv_pool = pool_.data();
  view_.kv_indices = indices_.data();
  view_.shape.num_pages = v.shape.num_indices;
  view_.shape.kv_dtype = kernels::KvDtype::kBf16;
  view_.sm_scale = v.sm_scale * v.kv_scale;  // ValidateBundle: finite and > 0
  view_.o_scale = v.kv_scale;
  view_.kv_scale = 1.f;
  view_.kv_pool_shared = false;
}

}  // namespace verifyd
