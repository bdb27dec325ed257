#pragma once
// A call's layout on one lane of a GPU: kv_indptr and kv_lens, and the page ids and tree mask as
// the checked copy left them (input_check_kernels.h), with the checks' outcome. A bundle whose
// page ids are in device memory reads them from one. Calls that name the same layout
// (BundleView::layout_key) share it: the first uploads and checks it, and later calls on the same
// lane with the same key, the same tensors and the same kv_indptr and kv_lens read that copy
// (LayoutCache), so that the 61 layers of a forward pass check their layout once.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/reference/input_check_kernels.h"
#include "kernels/verify_problem.h"
#include "src/bundle/bundle.h"
#include "src/cuda_engine/device_worker.h"

namespace verifyd {

class DeviceLayout {
 public:
  // Its identity: `v`'s key, tensors and shape. The caller uploads it (the pointers below) and
  // records ready().
  DeviceLayout(DeviceWorker& worker, Lane& lane, const BundleView& v);
  // Gives its device memory back on the lane's served stream: every kernel that read it was
  // ordered before that by the bundles that held it.
  ~DeviceLayout();
  DeviceLayout(const DeviceLayout&) = delete;
  DeviceLayout& operator=(const DeviceLayout&) = delete;

  // Whether a call of view `v` may read this layout instead of its own.
  bool Matches(const BundleView& v) const;
  uint64_t key() const { return key_; }

  // Device memory, filled by the uploader.
  void* allocation = nullptr;
  const int32_t* indptr = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* indices = nullptr;  // checked: a bad page id reads page 0
  const uint8_t* mask = nullptr;
  kernels::InputCheckStatus* check_device = nullptr;
  // A pinned slot the outcome is copied into (null: read with a copy of its own).
  kernels::InputCheckStatus* check_host = nullptr;
  cudaEvent_t ready = nullptr;  // on the lane's served stream, after the copies and the checks

  // The checks' outcome: INVALID_ARGUMENT naming the first bad entry, as ValidateBundle would.
  // Waits for ready() the first time, and keeps what it read.
  absl::Status Checks() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether Checks() has read the outcome: then `ready` has completed.
  bool Read() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  DeviceWorker& worker_;
  Lane& lane_;
  const uint64_t key_;
  const int32_t* const src_indices_;
  const uint8_t* const src_mask_;
  const kernels::ProblemShape shape_;
  const std::vector<int32_t> indptr_host_, lens_host_;

  absl::Mutex mu_;
  std::optional<absl::Status> checks_ ABSL_GUARDED_BY(mu_);
};

// The layouts a lane keeps for reuse, the most recent first (kSize at most).
class LayoutCache {
 public:
  static constexpr size_t kSize = 4;
  // A kept layout that `v` (layout_key nonzero) may read, or null.
  std::shared_ptr<DeviceLayout> Find(const BundleView& v) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `l`, in place of any with its key; the least recent goes past kSize.
  void Keep(std::shared_ptr<DeviceLayout> l) ABSL_LOCKS_EXCLUDED(mu_);
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<DeviceLayout>> kept_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
