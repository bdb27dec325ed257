#pragma once
// One GPU's share of the CUDA engine: its stream-ordered memory pool and a few lanes. A lane is a
// pair of streams (served path, shadow path) with the cuBLAS handle and pinned staging buffers
// that go with them; bundles are spread over the lanes so that concurrent calls overlap.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/reference/compare_kernels.h"
#include "src/cuda_engine/check_slots.h"
#include "src/cuda_engine/event_pool.h"
#include "src/cuda_engine/pinned_buffer.h"
#include "src/engine/engine.h"

namespace verifyd {

class LayoutCache;  // device_layout.h

// A pinned buffer and the event after which the last copy through it is done.
struct Staging {
  absl::Mutex mu;
  PinnedBuffer buffer ABSL_GUARDED_BY(mu);
  cudaEvent_t copied = nullptr;  // recorded after each copy; used under mu
};

struct Lane {
  // the reference path and the input copies, at the device's highest stream priority
  cudaStream_t served = nullptr;
  // the custom path, the oracle and the comparisons, at its lowest
  cudaStream_t shadow = nullptr;

  absl::Mutex blas_mu;  // a cuBLAS handle is not safe for concurrent calls
  cublasHandle_t blas ABSL_GUARDED_BY(blas_mu) = nullptr;  // bound to `served` per launch

  Staging input;          // host -> device copies of bundles
  Staging output_served;  // device -> host copies of outputs on `served`
  Staging output_shadow;  // ... on `shadow`

  absl::Mutex compare_mu;  // one comparison at a time per lane: shared partials and result
  void* compare_workspace ABSL_GUARDED_BY(compare_mu) = nullptr;  // device
  kernels::DeviceDiffStats* compare_device ABSL_GUARDED_BY(compare_mu) = nullptr;
  kernels::DeviceDiffStats* compare_host ABSL_GUARDED_BY(compare_mu) = nullptr;  // pinned
  cudaEvent_t compare_done = nullptr;

  absl::Mutex finite_mu;  // one finite check at a time per lane: shared flag
  unsigned* finite_device ABSL_GUARDED_BY(finite_mu) = nullptr;
  unsigned* finite_host ABSL_GUARDED_BY(finite_mu) = nullptr;    // pinned, mapped
  unsigned* finite_mapped ABSL_GUARDED_BY(finite_mu) = nullptr;  // finite_host, as the GPU sees it
  cudaEvent_t finite_done = nullptr;

  EventPool events;  // the events its calls record
  // Layouts that later calls on this lane may read again (BundleView::layout_key).
  std::unique_ptr<LayoutCache> layouts;
};

class DeviceWorker {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceWorker>> Create(
      int device, size_t pool_bytes, int lanes, absl::Duration sync_spin = absl::ZeroDuration());
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;
  ~DeviceWorker();

  int device() const { return device_; }
  const cudaDeviceProp& props() const { return props_; }
  cudaMemPool_t pool() const { return pool_; }
  Lane& NextLane();
  CheckSlots& check_slots() { return check_slots_; }

  // Makes this device current on the calling thread; DATA_LOSS once the context is lost.
  absl::Status Activate();
  // Called once, from the call that finds the context lost (outside the worker's locks).
  void SetLostHandler(DeviceLostHandler handler);
  // CudaStatus(e, where) that also remembers a lost context, failing every later call.
  absl::Status Check(cudaError_t e, absl::string_view where);
  // Waits for `s`'s work (or `e`) on the call's critical path: polls for the worker's sync spin,
  // then between naps that grow with the wait, then blocks (the device's waits block:
  // cudaDeviceScheduleBlockingSync); with no sync spin, blocks at once.
  absl::Status AwaitCritical(cudaStream_t s, absl::string_view where);
  absl::Status AwaitCritical(cudaEvent_t e, absl::string_view where);

 private:
  // Out of line: a Lane's LayoutCache is complete only in device_worker.cc.
  DeviceWorker(int device, absl::Duration sync_spin);
  absl::Status Init(size_t pool_bytes, int lanes);

  const int device_;
  const absl::Duration sync_spin_;
  cudaDeviceProp props_{};
  cudaMemPool_t pool_ = nullptr;
  std::vector<std::unique_ptr<Lane>> lanes_;
  CheckSlots check_slots_;
  std::atomic<unsigned> next_lane_{0};
  std::atomic<bool> lost_{false};
  mutable absl::Mutex lost_mu_;
  std::string lost_reason_ ABSL_GUARDED_BY(lost_mu_);
  DeviceLostHandler on_lost_ ABSL_GUARDED_BY(lost_mu_);
};

}  // namespace verifyd
