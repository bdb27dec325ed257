#include "src/cuda_engine/device_layout.h"

#include <algorithm>

#include "src/bundle/validate.h"

namespace verifyd {

DeviceLayout::DeviceLayout(DeviceWorker& worker, Lane& lane, const BundleView& v)
    : worker_(worker),
      lane_(lane),
      key_(v.layout_key),
      src_indices_(v.kv_indices),
      src_mask_(v.tree_mask),
      shape_(v.shape),
      indptr_host_(v.kv_indptr, v.kv_indptr + v.shape.batch + 1),
      lens_host_(v.kv_lens, v.kv_lens + v.shape.batch) {}

DeviceLayout::~DeviceLayout() {
  if (!worker_.Activate().ok()) return;  // the context is lost: nothing left to free
  if (allocation != nullptr) cudaFreeAsync(allocation, lane_.served);
  if (check_host != nullptr) {  // its copy, before ready, may still be in flight
    cudaEventSynchronize(ready);
    worker_.check_slots().Release(check_host);
  }
  lane_.events.Give(EventPool::Kind::kOrdering, ready);
  cudaGetLastError();  // nothing to report from a destructor
}

bool DeviceLayout::Matches(const BundleView& v) const {
  const kernels::ProblemShape& s = v.shape;
  return v.layout_key == key_ && v.kv_indices == src_indices_ && v.tree_mask == src_mask_ &&
         s.batch == shape_.batch && s.draft == shape_.draft &&
         s.mask_format == shape_.mask_format && s.num_indices == shape_.num_indices &&
         s.num_pages == shape_.num_pages &&
         std::equal(indptr_host_.begin(), indptr_host_.end(), v.kv_indptr) &&
         std::equal(lens_host_.begin(), lens_host_.end(), v.kv_lens);
}

absl::Status DeviceLayout::Checks() {
  absl::MutexLock lock(&mu_);
  if (checks_) return *checks_;
  const char* where = "reading the outcome of the checks on the device";
  // The outcome was copied before `ready`.
  kernels::InputCheckStatus status{};
  absl::Status st = worker_.AwaitCritical(ready, where);
  if (st.ok() && check_host != nullptr) {
    status = *check_host;
  } else if (st.ok()) {
    st = worker_.Check(cudaMemcpy(&status, check_device, sizeof(status), cudaMemcpyDeviceToHost),
                       where);
  }
  if (!st.ok()) return st;  // not kept: a device error is the device's, not the call's
  worker_.check_slots().Release(check_host);
  check_host = nullptr;
  if (status.bad_index != kernels::kNoBadEntry) {
    checks_ = BadPageId(static_cast<int64_t>(status.bad_index >> 32),
                        static_cast<int32_t>(status.bad_index & 0xffffffffu), shape_.num_pages);
  } else if (status.bad_mask != kernels::kNoBadEntry) {
    checks_ = BadMaskByte(shape_, static_cast<int64_t>(status.bad_mask >> 32),
                          static_cast<uint8_t>(status.bad_mask & 0xffu));
  } else {
    checks_ = absl::OkStatus();
  }
  return *checks_;
}

bool DeviceLayout::Read() {
  absl::MutexLock lock(&mu_);
  return checks_.has_value();
}

std::shared_ptr<DeviceLayout> LayoutCache::Find(const BundleView& v) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < kept_.size(); ++i) {
    if (!kept_[i]->Matches(v)) continue;
    std::rotate(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(i),
                kept_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    return kept_.front();
  }
  return nullptr;
}

void LayoutCache::Keep(std::shared_ptr<DeviceLayout> l) {
  std::shared_ptr<DeviceLayout> gone;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto same =
      std::find_if(kept_.begin(), kept_.end(), [&](const auto& k) { return k->key() == l->key(); });
  if (same != kept_.end()) {
    gone = std::move(*same);
    kept_.erase(same);
  } else if (kept_.size() >= kSize) {
    gone = std::move(kept_.back());
    kept_.pop_back();
  }
  kept_.insert(kept_.begin(), std::move(l));
}

void LayoutCache::Clear() {
  std::vector<std::shared_ptr<DeviceLayout>> gone;
  absl::MutexLock lock(&mu_);
  gone.swap(kept_);
}

}  // namespace verifyd
