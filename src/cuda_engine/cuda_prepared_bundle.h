#pragma once
// A bundle's inputs on one GPU (one device copy that every path reads) and the outputs and
// timing events of the paths that ran on it. Device memory comes from the worker's pool and goes
// back to it, stream-ordered, when the last reference to the bundle is dropped.

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/reference/input_check_kernels.h"
#include "kernels/verify_problem.h"
#include "src/cuda_engine/device_layout.h"
#include "src/cuda_engine/device_worker.h"
#include "src/engine/engine.h"

namespace verifyd {

// One path's device output: o bf16 [B*T, H, 512] (fp32 for the oracle), lse fp32 [B*T, H].
struct DevicePathOutput {
  void* o = nullptr;
  float* lse = nullptr;
  cudaEvent_t start = nullptr;  // timing events around the path's kernels
  cudaEvent_t done = nullptr;
  bool ran = false;
};

class CudaPreparedBundle : public PreparedBundle {
 public:
  CudaPreparedBundle(DeviceWorker& worker, Lane& lane, const BundleView& v);
  ~CudaPreparedBundle() override;

  DeviceWorker& worker() const { return worker_; }
  Lane& lane() const { return lane_; }
  // Device pointers of the inputs as the call sent them (an e4m3 pool as its e4m3 bytes,
  // shape.kv_dtype and kv_scale saying so); o and lse are left null for each path to fill in. What
  // the oracle reads and a capture writes out.
  const kernels::VerifyProblem& sent() const { return problem_; }
  // The inputs with a bf16 pool, for a path that reads one on stream `s`: sent() for a bf16 pool.
  // An e4m3 pool's named pages are dequantised on the device into a compact bf16 pool of their
  // exact values, with the scale on sm_scale and on o before its rounding
  // (VerifyProblem::o_scale): once, on the first stream that asks, after the upload; a later
  // stream waits for it. A call no such path reads (custom mode, v3e, the reference not sampled)
  // never pays for it.
  absl::StatusOr<kernels::VerifyProblem> Bf16Problem(cudaStream_t s) ABSL_LOCKS_EXCLUDED(dq_mu_);
  // What the custom kernel reads on `s`: an e4m3 pool's codes as sent where the kernel that reads
  // them runs under `config` (v3e, on sm_90), as the op in the serving process reads them, so
  // that the custom path shares no dequantisation with the reference and a wrong one shows per
  // call; elsewhere Bf16Problem(s).
  absl::StatusOr<kernels::VerifyProblem> CustomProblem(const kernels::CustomConfig& config,
                                                       cudaStream_t s);
  float kv_scale() const { return kv_scale_; }
  cudaEvent_t inputs_ready() const { return inputs_ready_; }
  // Makes `s`'s later work wait for the inputs (none when they are known to be there already: a
  // layout read earlier, and nothing else to copy).
  absl::Status AwaitInputsOn(cudaStream_t s, absl::string_view where);
  int64_t o_elems() const { return o_elems_; }
  int64_t lse_elems() const { return lse_elems_; }

  // Copies the bundle's host tensors through the lane's pinned staging into one pool allocation,
  // on the served stream; returns before the copy ends (inputs_ready() marks it). Tensors in a
  // CUDA IPC region are read in place, or with `detach` (work after the response) snapshotted
  // on the device: q copied, the pool's named pages gathered. A shared pool that is copied keeps
  // only the pages the bundle names (problem().shape.num_pages is then num_indices).
  // Page ids in device memory are checked as they are copied, with kv_indptr, kv_lens and the
  // mask, into a DeviceLayout, which the lane keeps for later calls of the same layout_key.
  absl::Status Upload(const BundleView& v, bool detach);
  // Whether the kernels read the pool where the client keeps it (problem().kv_pool is then the
  // client's whole pool).
  bool pool_in_place() const { return pool_in_place_; }
  // The outcome of the checks Upload made on the device (Engine::InputChecks); OK when the
  // bundle was checked on the host.
  absl::Status InputChecks();

  // The path's output buffers and events, allocated on `stream` the first time.
  absl::StatusOr<DevicePathOutput> Outputs(Path p, cudaStream_t stream) ABSL_LOCKS_EXCLUDED(mu_);
  void MarkRan(Path p) ABSL_LOCKS_EXCLUDED(mu_);
  // A copy of the path's state; ran == false until MarkRan.
  DevicePathOutput State(Path p) const ABSL_LOCKS_EXCLUDED(mu_);
  // Records that work on the shadow stream touched this bundle (freeing waits for it).
  absl::Status RecordShadowUse() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<std::shared_ptr<DeviceLayout>> UploadLayout(const BundleView& v, bool detach);

  DeviceWorker& worker_;
  Lane& lane_;
  // The bf16 pages of an e4m3 pool and their page ids 0, 1, ..., made on `s` (bf16_ then points
  // at them).
  absl::Status Dequantize(cudaStream_t s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(dq_mu_);

  kernels::VerifyProblem problem_;
  float kv_scale_ = 1.f;
  bool e4m3_ = false;
  absl::Mutex dq_mu_;
  kernels::VerifyProblem bf16_ ABSL_GUARDED_BY(dq_mu_);
  void* dequantized_ ABSL_GUARDED_BY(dq_mu_) = nullptr;
  cudaEvent_t dequantized_ready_ ABSL_GUARDED_BY(dq_mu_) = nullptr;
  cudaStream_t dequantized_on_ ABSL_GUARDED_BY(dq_mu_) = nullptr;
  std::optional<absl::Status> dequantized_status_ ABSL_GUARDED_BY(dq_mu_);  // once tried
  int64_t o_elems_ = 0, lse_elems_ = 0;
  void* inputs_ = nullptr;
  cudaEvent_t inputs_ready_ = nullptr;
  bool q_in_place_ = false, pool_in_place_ = false;

  // The layout, when its page ids are in device memory (checked there).
  std::shared_ptr<DeviceLayout> layout_;
  bool owns_inputs_ready_ = false;  // else it is layout_'s
  bool inputs_done_ = false;        // inputs_ready_ is known to have completed

  mutable absl::Mutex mu_;
  DevicePathOutput paths_[3] ABSL_GUARDED_BY(mu_);
  cudaEvent_t shadow_last_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace verifyd
