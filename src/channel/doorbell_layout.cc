#include "src/channel/doorbell_layout.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/proto_tensors.h"

namespace verifyd::channel {
namespace {

absl::Status Bad(int i, const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("descriptors[", i, "].", field, ": ", why));
}

bool InRegion(const v1::Tensor& t) { return t.has_shm() || t.has_cuda_ipc(); }

// A tensor the descriptor must name in a region, with `rank` dimensions.
absl::Status CheckRegionTensor(int i, const char* field, const v1::Tensor& t, int rank) {
  if (!InRegion(t)) {
    return Bad(i, field, "must name a region range (shm or cuda_ipc), at its largest shape");
  }
  if (t.shape_size() != rank) {
    return Bad(i, field, absl::StrCat("has ", t.shape_size(), " dimensions, expected ", rank));
  }
  for (int64_t d : t.shape()) {
    if (d < 1) return Bad(i, field, absl::StrCat("dimension ", d, " must be at least 1"));
  }
  return absl::OkStatus();
}

absl::Status CheckDescriptor(int i, const v1::VerifyRequest& d, DoorbellPlan* plan) {
  if (d.has_kv_indptr()) return Bad(i, "kv_indptr", "comes from the layout slot; leave it unset");
  if (d.has_kv_lens()) return Bad(i, "kv_lens", "comes from the layout slot; leave it unset");
  if (absl::Status st = CheckRegionTensor(i, "q", d.q(), 3); !st.ok()) return st;
  if (!InRegion(d.kv_pool())) return Bad(i, "kv_pool", "must name a region range");
  if (absl::Status st = CheckRegionTensor(i, "kv_indices", d.kv_indices(), 1); !st.ok()) return st;
  if (absl::Status st = CheckRegionTensor(i, "tree_mask", d.tree_mask(), 3); !st.ok()) return st;
  if (absl::Status st = CheckRegionTensor(i, "o_out", d.o_out(), 3); !st.ok()) return st;
  if (d.want_lse()) {
    if (absl::Status st = CheckRegionTensor(i, "lse_out", d.lse_out(), 2); !st.ok()) return st;
  }
  const int64_t batch = d.tree_mask().shape(0), draft = d.tree_mask().shape(1);
  const int64_t rows = batch * draft;
  if (d.q().shape(0) != rows) {
    return Bad(i, "q",
               absl::StrCat(d.q().shape(0), " rows, expected max_batch * T = ", batch, " * ", draft,
                            " (from tree_mask)"));
  }
  if (d.o_out().shape(0) != rows) {
    return Bad(i, "o_out", absl::StrCat(d.o_out().shape(0), " rows, expected ", rows));
  }
  if (d.want_lse() && d.lse_out().shape(0) != rows) {
    return Bad(i, "lse_out", absl::StrCat(d.lse_out().shape(0), " rows, expected ", rows));
  }
  if (i == 0) {
    plan->max_batch = batch;
    plan->draft = draft;
  } else if (batch != plan->max_batch || draft != plan->draft) {
    return Bad(i, "tree_mask",
               absl::StrCat("max_batch ", batch, " and T ", draft, " differ from descriptors[0]'s ",
                            plan->max_batch, " and ", plan->draft,
                            " (a layout slot serves every descriptor)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DoorbellPlan> PlanDoorbell(
    const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& descriptors, uint32_t slots,
    uint64_t capacity) {
  if (descriptors.empty() || descriptors.size() > static_cast<int>(kMaxDescriptors)) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptors: ", descriptors.size(), ", expected 1 to ", kMaxDescriptors));
  }
  DoorbellPlan plan;
  for (int i = 0; i < descriptors.size(); ++i) {
    if (absl::Status st = CheckDescriptor(i, descriptors[i], &plan); !st.ok()) return st;
  }
  if (plan.max_batch > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptors[0].tree_mask: max_batch ", plan.max_batch, " is too large"));
  }
  plan.slots = slots == 0 ? kDefaultLayoutSlots : slots;
  if (plan.slots > kMaxLayoutSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout_slots: ", plan.slots, ", at most ", kMaxLayoutSlots));
  }
  const uint64_t words = 3 + 2 * static_cast<uint64_t>(plan.max_batch);
  plan.slot_bytes = static_cast<uint32_t>((words * 4 + 63) / 64 * 64);
  if (uint64_t{plan.slots} * plan.slot_bytes > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout_slots: ", plan.slots, " slots of ", plan.slot_bytes,
        " bytes do not fit the request area of ", capacity, " bytes (open a larger channel)"));
  }
  return plan;
}

absl::Status BuildDoorbellCall(
    const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& descriptors,
    const DoorbellPlan& plan, Ring ring, const char* request_area, v1::VerifyRequest* call,
    uint32_t* generation) {
  if (ring.descriptor >= static_cast<uint32_t>(descriptors.size())) {
    return absl::InvalidArgumentError(absl::StrCat("doorbell: descriptor ", ring.descriptor,
                                                   ", the channel has ", descriptors.size()));
  }
  if (ring.slot >= plan.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("doorbell: layout slot ", ring.slot, ", the channel has ", plan.slots));
  }
  const int64_t max_batch = plan.max_batch;
  std::vector<int32_t> w(3 + 2 * static_cast<size_t>(max_batch));
  std::memcpy(w.data(), request_area + uint64_t{ring.slot} * plan.slot_bytes, w.size() * 4);
  if (generation != nullptr) *generation = static_cast<uint32_t>(w[1]);
  const int64_t batch = w[0];
  if (batch < 1 || batch > max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("batch: ", batch, " in layout slot ", ring.slot,
                                                   " is outside 1 to max_batch ", max_batch));
  }
  const v1::VerifyRequest& d = descriptors[static_cast<int>(ring.descriptor)];
  const int64_t indices = w[2 + batch], max_indices = d.kv_indices().shape(0);
  if (indices < 1 || indices > max_indices) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_indptr[", batch, "]: ", indices, " in layout slot ", ring.slot,
                     " is outside 1 to the descriptor's ", max_indices, " kv_indices"));
  }
  *call = d;
  CutRows(call->mutable_q(), batch * plan.draft);
  CutRows(call->mutable_tree_mask(), batch);
  CutRows(call->mutable_o_out(), batch * plan.draft);
  if (call->has_lse_out()) CutRows(call->mutable_lse_out(), batch * plan.draft);
  CutRows(call->mutable_kv_indices(), indices);
  InlineI32(call->mutable_kv_indptr(), &w[2], batch + 1);
  InlineI32(call->mutable_kv_lens(), &w[3 + static_cast<size_t>(max_batch)], batch);
  return absl::OkStatus();
}

}  // namespace verifyd::channel
