#include "src/channel/tap_layout.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/proto_tensors.h"

namespace verifyd::channel {
namespace {

absl::Status Bad(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("tap.", field, ": ", why));
}

absl::Status InRange(const char* field, uint64_t v, uint64_t lo, uint64_t hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return Bad(field, absl::StrCat(v, " is outside ", lo, " to ", hi));
}

void RegionRange(v1::Tensor* t, const std::string& region, bool shm, uint64_t offset,
                 uint64_t bytes) {
  if (shm) {
    t->mutable_shm()->set_region(region);
    t->mutable_shm()->set_offset(offset);
    t->mutable_shm()->set_byte_size(bytes);
  } else {
    t->mutable_cuda_ipc()->set_region(region);
    t->mutable_cuda_ipc()->set_offset(offset);
    t->mutable_cuda_ipc()->set_byte_size(bytes);
  }
}

void Shape(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> dims) {
  t->set_dtype(dtype);
  for (int64_t d : dims) t->add_shape(d);
}

}  // namespace

bool IsBackendLabel(const std::string& s) {
  if (s.empty() || s.size() > 32) return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

absl::StatusOr<TapPlan> PlanTap(const v1::TapSpec& spec, uint64_t capacity) {
  if (!IsBackendLabel(spec.backend())) {
    return Bad("backend", absl::StrCat("'", spec.backend().substr(0, 40),
                                       "' must be 1 to 32 characters of [a-z0-9_]"));
  }
  if (spec.region().empty()) return Bad("region", "names no registered region");
  if (absl::Status st = InRange("slots", spec.slots(), 1, kMaxTapSlots); !st.ok()) return st;
  if (absl::Status st = InRange("max_batch", spec.max_batch(), 1, 4096); !st.ok()) return st;
  if (absl::Status st = InRange("draft", spec.draft(), 1, 1024); !st.ok()) return st;
  if (absl::Status st = InRange("heads", spec.heads(), 1, 128); !st.ok()) return st;
  if (absl::Status st = InRange("max_pages", spec.max_pages(), 1, 1u << 24); !st.ok()) return st;
  if (absl::Status st = InRange("page_size", spec.page_size(), 1, 1024); !st.ok()) return st;
  if (spec.mask_format() != v1::MASK_FORMAT_BYTES && spec.mask_format() != v1::MASK_FORMAT_BITS) {
    return Bad("mask_format",
               absl::StrCat(static_cast<int>(spec.mask_format()), " is not a MaskFormat"));
  }
  if (!(spec.sm_scale() > 0) || !std::isfinite(spec.sm_scale())) {
    return Bad("sm_scale", absl::StrCat(spec.sm_scale(), " must be finite and positive"));
  }
  if (spec.device() < 0) return Bad("device", absl::StrCat(spec.device(), " is negative"));
  if (spec.region_offset() % 16 != 0) {
    return Bad("region_offset", absl::StrCat(spec.region_offset(), " is not a multiple of 16"));
  }
  TapPlan plan;
  plan.spec = spec;
  if (spec.kv_dtype() == v1::DTYPE_UNSPECIFIED) plan.spec.set_kv_dtype(v1::DTYPE_BF16);
  if (plan.spec.kv_dtype() != v1::DTYPE_BF16 && plan.spec.kv_dtype() != v1::DTYPE_F8E4M3) {
    const std::string name = v1::DType_Name(spec.kv_dtype());
    return Bad("kv_dtype", absl::StrCat(name.empty() ? std::to_string(spec.kv_dtype()) : name,
                                        " is not a KV pool dtype: DTYPE_BF16 or DTYPE_F8E4M3"));
  }
  plan.geometry = tap::TapGeometry(spec.max_batch(), spec.draft(), spec.heads(), spec.max_pages(),
                                   spec.page_size(), spec.mask_format() == v1::MASK_FORMAT_BITS,
                                   static_cast<uint64_t>(DTypeBytes(plan.spec.kv_dtype())));
  plan.region_bytes = plan.geometry.SlotOffset(spec.slots());
  if (uint64_t{spec.slots()} * plan.geometry.record_bytes > capacity) {
    return Bad("slots", absl::StrCat(spec.slots(), " records of ", plan.geometry.record_bytes,
                                     " bytes do not fit the request area of ", capacity,
                                     " bytes (open a larger channel)"));
  }
  return plan;
}

v1::VerifyRequest TapSlotCall(const TapPlan& plan, uint32_t slot, bool shm_region) {
  const v1::TapSpec& s = plan.spec;
  const tap::TapSlotGeometry& g = plan.geometry;
  const int64_t rows = int64_t{s.max_batch()} * s.draft();
  const uint64_t at = s.region_offset() + g.SlotOffset(slot);
  v1::VerifyRequest call;
  Shape(call.mutable_q(), v1::DTYPE_BF16, {rows, s.heads(), 576});
  RegionRange(call.mutable_q(), s.region(), shm_region, at, g.q_bytes);
  Shape(call.mutable_o_out(), v1::DTYPE_BF16, {rows, s.heads(), 512});
  RegionRange(call.mutable_o_out(), s.region(), shm_region, at + g.o_offset, g.o_bytes);
  Shape(call.mutable_kv_pool(), s.kv_dtype(), {s.max_pages(), s.page_size(), 576});
  RegionRange(call.mutable_kv_pool(), s.region(), shm_region, at + g.kv_offset, g.kv_bytes);
  call.set_mask_format(s.mask_format());
  call.set_sm_scale(s.sm_scale());
  call.set_device(s.device());
  return call;
}

absl::Status BuildTapCall(const TapPlan& plan, const v1::VerifyRequest& slot_call,
                          const char* record, v1::VerifyRequest* call, uint32_t* call_number) {
  const v1::TapSpec& s = plan.spec;
  const tap::TapSlotGeometry& g = plan.geometry;
  std::vector<char> r(g.record_bytes);
  std::memcpy(r.data(), record, r.size());
  std::vector<int32_t> head(tap::kTapRecordWords + 2 * size_t{s.max_batch()} + 1);
  std::memcpy(head.data(), r.data(), head.size() * 4);
  *call_number = static_cast<uint32_t>(head[0]);
  const int64_t batch = head[1], pages = head[2];
  if ((static_cast<uint32_t>(head[3]) & tap::kTapMalformed) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tap: call ", *call_number,
                     " was malformed where the stack made it (a batch past max_batch, kv_indptr "
                     "past max_pages or decreasing, or a page id past the pool); nothing was "
                     "copied"));
  }
  if (batch < 1 || batch > s.max_batch()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch: ", batch, " is outside 1 to tap.max_batch ", s.max_batch()));
  }
  if (pages < 1 || pages > s.max_pages()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_indptr[", batch, "]: ", pages, " is outside 1 to tap.max_pages ", s.max_pages()));
  }
  const int32_t* indptr = &head[tap::kTapRecordWords];
  if (indptr[0] != 0 || indptr[batch] != pages) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indptr: starts at ", indptr[0],
                                                   " and ends at ", indptr[batch],
                                                   ", expected 0 and the record's ", pages));
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (indptr[b + 1] < indptr[b]) {
      return absl::InvalidArgumentError(absl::StrCat("kv_indptr[", b + 1, "]: ", indptr[b + 1],
                                                     " is less than kv_indptr[", b, "]"));
    }
  }
  *call = slot_call;
  call->set_request_id(absl::StrCat("tap:", s.backend(), ":", *call_number));
  if (s.kv_dtype() == v1::DTYPE_F8E4M3) {  // checked as any call's kv_scale (ValidateBundle)
    float kv_scale;
    std::memcpy(&kv_scale, &head[tap::kTapRecordKvScale], 4);
    call->set_kv_scale(kv_scale);
  }
  CutRows(call->mutable_q(), batch * s.draft());
  CutRows(call->mutable_o_out(), batch * s.draft());
  CutRows(call->mutable_kv_pool(), pages);
  InlineI32(call->mutable_kv_indptr(), indptr, batch + 1);
  InlineI32(call->mutable_kv_lens(), &head[tap::kTapRecordWords + s.max_batch() + 1], batch);
  std::vector<int32_t> iota(static_cast<size_t>(pages));
  std::iota(iota.begin(), iota.end(), 0);
  InlineI32(call->mutable_kv_indices(), iota.data(), pages);
  v1::Tensor* mask = call->mutable_tree_mask();
  mask->set_dtype(v1::DTYPE_U8);
  mask->add_shape(batch);
  mask->add_shape(s.draft());
  mask->add_shape(static_cast<int64_t>(g.mask_row_bytes));
  mask->set_raw_contents(r.data() + head.size() * 4,
                         static_cast<size_t>(batch * s.draft()) * g.mask_row_bytes);
  return absl::OkStatus();
}

}  // namespace verifyd::channel
