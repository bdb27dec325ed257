#pragma once
// The CUDA engine: one worker per GPU, each with lanes of two streams (served path, shadow
// path), a stream-ordered memory pool and reused pinned staging. Reference = K gather + cuBLAS +
// masked softmax, custom = the fused paged kernel, oracle = the fp32 kernel; Compare reduces on
// the device and brings back only the statistics.

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/custom/custom_attention.h"
#include "src/engine/engine.h"

namespace verifyd {

struct CudaEngineOptions {
  std::vector<int> devices;                    // CUDA device ordinals; empty = every visible GPU
  size_t memory_pool_bytes = size_t{8} << 30;  // per GPU: cap on the pool and what it keeps
  int lanes_per_device = 4;                    // stream pairs per GPU: calls that overlap
  // Waits block (the driver wakes the thread: tens of µs after the GPU is done), except that a
  // wait for the served output, on the call's critical path, polls for this long first.
  absl::Duration sync_spin = absl::Microseconds(100);
  kernels::CustomConfig custom;  // tiles and KV-split planning of the custom path
};

// GPUs the CUDA runtime sees; 0 when there are none or the driver cannot be loaded.
int VisibleCudaDevices();

class DeviceWorker;

class CudaEngine : public Engine {
 public:
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(const CudaEngineOptions& options);
  ~CudaEngine() override;

  EngineInfo Info() const override;
  // Spreads bundles over the devices in turn; PrepareOn picks one (index into the devices).
  absl::StatusOr<std::shared_ptr<PreparedBundle>> Prepare(const BundleView& bundle,
                                                          bool detach) override;
  absl::StatusOr<std::shared_ptr<PreparedBundle>> PrepareOn(int device_index,
                                                            const BundleView& bundle,
                                                            bool detach) override;
  // Reference runs on the served stream and returns once launched; custom runs on the shadow
  // stream and returns when it finished, so that its CUDA errors surface here; the oracle runs on
  // the shadow stream and returns once launched.
  absl::Status Run(Path path, PreparedBundle& b) override;
  // A call's served custom path returns without waiting for its kernels: AllFinite or
  // DeliverIfFinite, which RunServed calls next on the same stream, waits once for both.
  absl::Status RunForCall(Path path, PreparedBundle& b, const CallContext& call) override;
  // The custom path with the engine's tiles and `splits` KV splits (CustomConfig::force_splits),
  // waited for as Run(kCustom) is.
  absl::Status RunCustomSplits(PreparedBundle& b, int splits) override;
  absl::Status Fetch(Path path, PreparedBundle& b, PathOutput* out) override;
  absl::StatusOr<double> PathSeconds(Path path, PreparedBundle& b) override;
  // A device-to-device copy into a CUDA IPC region (a device-to-host one into a shm region) on
  // the path's stream, waited for.
  absl::Status ZeroFill(const RegionRange& r) override;
  absl::Status ReadRange(const RegionRange& r, void* dst) override;
  absl::Status WriteRange(const RegionRange& r, const void* src) override;
  absl::Status Deliver(Path path, PreparedBundle& b, const RegionRange& o,
                       const RegionRange* lse) override;
  absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpc(int device, const std::string& handle,
                                                            uint64_t byte_size) override;
  absl::StatusOr<std::unique_ptr<MappedRegion>> ImportCudaVmm(
      int device, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
      uint64_t offset, uint64_t byte_size) override;
  // cudaHostRegister (portable, mapped): every device's copy engine and kernels read it.
  absl::StatusOr<std::function<void()>> PinHostMemory(void* base, uint64_t bytes) override;
  // One reduction kernel over o and lse on the path's own stream; a 4-byte flag comes back.
  absl::StatusOr<bool> AllFinite(Path path, PreparedBundle& b) override;
  absl::StatusOr<bool> DeliverIfFinite(Path path, PreparedBundle& b, const RegionRange& o,
                                       const RegionRange* lse) override;
  absl::Status InputChecks(PreparedBundle& b) override;
  absl::StatusOr<DiffStats> Compare(PreparedBundle& b, Path test, Path ref,
                                    const Tolerance& tol) override;
  absl::StatusOr<std::shared_ptr<const OwnedBundle>> FetchInputs(PreparedBundle& b) override;
  void InjectCustomFault(const CustomFault& fault) override;
  void SetDeviceLostHandler(DeviceLostHandler handler) override;

  int num_devices() const { return static_cast<int>(workers_.size()); }

 private:
  explicit CudaEngine(const CudaEngineOptions& options);
  CustomFault fault() const;

  const CudaEngineOptions options_;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;
  std::atomic<unsigned> next_device_{0};
  mutable absl::Mutex fault_mu_;
  CustomFault fault_ ABSL_GUARDED_BY(fault_mu_);
};

// The engine, or null with *error (when given) saying why (no GPU, driver, pool creation).
std::unique_ptr<Engine> MakeCudaEngine(const CudaEngineOptions& options,
                                       absl::Status* error = nullptr);

}  // namespace verifyd
