#include "src/cuda_engine/cuda_engine.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/reference/compare_kernels.h"
#include "kernels/reference/finite_check_kernels.h"
#include "kernels/reference/kv_dequantize_kernels.h"
#include "kernels/reference/oracle_kernel.h"
#include "kernels/reference/output_fault_kernels.h"
#include "kernels/reference/page_gather_kernels.h"
#include "kernels/reference/reference_attention.h"
#include "src/common/status_macros.h"
#include "src/cuda_engine/cuda_ipc_mapping.h"
#include "src/cuda_engine/cuda_prepared_bundle.h"
#include "src/cuda_engine/cuda_status.h"
#include "src/cuda_engine/cuda_vmm_mapping.h"
#include "src/cuda_engine/device_diff_stats.h"
#include "src/cuda_engine/device_worker.h"

namespace verifyd {
namespace {

absl::Status NotRun(Path p) {
  return absl::FailedPreconditionError(
      absl::StrCat("path ", PathName(p), " has not run on this bundle"));
}

// Device memory from the worker's pool for the duration of one path's launch, given back
// stream-ordered on the same stream (after every kernel that uses it).
class ScopedWorkspace {
 public:
  explicit ScopedWorkspace(cudaStream_t stream) : stream_(stream) {}
  ~ScopedWorkspace() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  absl::Status Allocate(DeviceWorker& w, size_t bytes, absl::string_view where) {
    if (bytes == 0) return absl::OkStatus();
    absl::Status st = w.Check(cudaMallocFromPoolAsync(&ptr_, bytes, w.pool(), stream_), where);
    if (!st.ok()) ptr_ = nullptr;
    bytes_ = bytes;
    return st;
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return ptr_ != nullptr ? bytes_ : 0; }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

absl::Status RunReference(CudaPreparedBundle& b) {
  DeviceWorker& w = b.worker();
  Lane& lane = b.lane();
  const cudaStream_t s = lane.served;
  const char* where = "reference path";
  // Same stream as the upload: the inputs are there in stream order.
  VERIFYD_ASSIGN_OR_RETURN(const DevicePathOutput out, b.Outputs(Path::kReference, s));
  VERIFYD_ASSIGN_OR_RETURN(kernels::VerifyProblem p, b.Bf16Problem(s));
  p.o = static_cast<uint16_t*>(out.o);
  p.lse = out.lse;
  ScopedWorkspace ws(s);
  VERIFYD_RETURN_IF_ERROR(ws.Allocate(w, kernels::ReferenceWorkspaceBytes(p), where));
  {
    absl::MutexLock lock(&lane.blas_mu);
    VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventRecord(out.start, s), where));
    VERIFYD_RETURN_IF_ERROR(
        w.Check(kernels::LaunchReference(p, ws.get(), ws.bytes(), lane.blas, s), where));
    VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventRecord(out.done, s), where));
  }
  b.MarkRan(Path::kReference);
  return absl::OkStatus();
}

absl::Status LaunchCustomPath(CudaPreparedBundle& b, const kernels::CustomConfig& config,
                              const CustomFault& fault, const DevicePathOutput& out) {
  DeviceWorker& w = b.worker();
  const cudaStream_t s = b.lane().shadow;
  const char* where = "custom path";
  VERIFYD_ASSIGN_OR_RETURN(kernels::VerifyProblem p, b.CustomProblem(config, s));
  p.o = static_cast<uint16_t*>(out.o);
  p.lse = out.lse;
  ScopedWorkspace ws(s);
  VERIFYD_RETURN_IF_ERROR(ws.Allocate(w, kernels::CustomWorkspaceBytes(p, config), where));
  VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventRecord(out.start, s), where));
  VERIFYD_RETURN_IF_ERROR(
      w.Check(kernels::LaunchCustom(p, config, ws.get(), ws.bytes(), s), where));
  const int64_t n = b.o_elems();
  if (fault.kind == CustomFault::Kind::kPerturb) {
    VERIFYD_RETURN_IF_ERROR(
        w.Check(kernels::LaunchAddToBf16(p.o, n, static_cast<float>(fault.amount), s), where));
  } else if (fault.kind == CustomFault::Kind::kNan) {
    VERIFYD_RETURN_IF_ERROR(w.Check(kernels::LaunchFillNanBf16(p.o, n > 0 ? 1 : 0, s), where));
  }
  return w.Check(cudaEventRecord(out.done, s), where);
}

// `wait`: returns once the kernels are done, which ties an asynchronous fault of the custom
// kernel to this run. Without it, the next wait on the shadow stream finds the fault.
absl::Status RunCustom(CudaPreparedBundle& b, const kernels::CustomConfig& config,
                       const CustomFault& fault, bool wait) {
  if (fault.kind == CustomFault::Kind::kError) {
    return absl::InternalError("injected custom-path fault");
  }
  DeviceWorker& w = b.worker();
  const cudaStream_t s = b.lane().shadow;
  const char* where = "custom path";
  VERIFYD_RETURN_IF_ERROR(b.AwaitInputsOn(s, where));
  VERIFYD_ASSIGN_OR_RETURN(const DevicePathOutput out, b.Outputs(Path::kCustom, s));
  absl::Status st = LaunchCustomPath(b, config, fault, out);
  if (absl::Status rec = b.RecordShadowUse(); st.ok()) st = rec;
  VERIFYD_RETURN_IF_ERROR(st);
  if (wait) VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventSynchronize(out.done), where));
  b.MarkRan(Path::kCustom);
  return absl::OkStatus();
}

absl::Status RunOracle(CudaPreparedBundle& b) {
  DeviceWorker& w = b.worker();
  const cudaStream_t s = b.lane().shadow;
  const char* where = "oracle path";
  VERIFYD_RETURN_IF_ERROR(b.AwaitInputsOn(s, where));
  VERIFYD_ASSIGN_OR_RETURN(const DevicePathOutput out, b.Outputs(Path::kOracle, s));
  absl::Status st = w.Check(cudaEventRecord(out.start, s), where);
  if (st.ok()) {  // an e4m3 pool as sent: the oracle reads it itself, not the dequantised pages
    st = w.Check(kernels::LaunchOracle(b.sent(), static_cast<float*>(out.o), out.lse, s), where);
  }
  if (st.ok()) st = w.Check(cudaEventRecord(out.done, s), where);
  if (absl::Status rec = b.RecordShadowUse(); st.ok()) st = rec;
  VERIFYD_RETURN_IF_ERROR(st);
  b.MarkRan(Path::kOracle);
  return absl::OkStatus();
}

// The stream a path's output was written on: the reference's is the served stream, the others'
// the shadow stream.
cudaStream_t PathStream(CudaPreparedBundle& b, Path path) {
  return path == Path::kReference ? b.lane().served : b.lane().shadow;
}

// A served path's output (reference or custom) that may go to ranges `o` and `lse` (null: none).
absl::StatusOr<DevicePathOutput> DeliverableOutput(CudaPreparedBundle& b, Path path,
                                                   const RegionRange& o, const RegionRange* lse) {
  if (path == Path::kOracle) return absl::InvalidArgumentError("o_out: the oracle is not served");
  const DevicePathOutput out = b.State(path);
  if (!out.ran) return NotRun(path);
  if (o.byte_size != size_t(b.o_elems()) * 2 ||
      (lse != nullptr && lse->byte_size != size_t(b.lse_elems()) * 4)) {
    return absl::InternalError("o_out: the output ranges do not match the bundle's outputs");
  }
  return out;
}

// Queues the copy of a path's output (reference or custom) into registered regions on the path's
// stream.
absl::Status EnqueueDeliver(CudaPreparedBundle& b, Path path, const RegionRange& o,
                            const RegionRange* lse, const std::string& where) {
  VERIFYD_ASSIGN_OR_RETURN(const DevicePathOutput st, DeliverableOutput(b, path, o, lse));
  DeviceWorker& w = b.worker();
  const cudaStream_t s = PathStream(b, path);
  auto copy = [&](const RegionRange& to, const void* from, size_t bytes) {
    return w.Check(
        cudaMemcpyAsync(to.data, from, bytes,
                        to.device() >= 0 ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost, s),
        where);
  };
  absl::Status done = copy(o, st.o, o.byte_size);
  if (done.ok() && lse != nullptr) done = copy(*lse, st.lse, lse->byte_size);
  if (path != Path::kReference) {
    if (absl::Status rec = b.RecordShadowUse(); done.ok()) done = rec;
  }
  return done;
}

// Queues the finite check of a path's output (reference or custom) on the path's stream: the
// lane's flag cleared, set by the check, copied to the host before lane.finite_done. The caller
// holds lane.finite_mu until it has read the flag.
absl::Status EnqueueFiniteCheck(CudaPreparedBundle& b, Path path, const std::string& where)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(b.lane().finite_mu) {
  if (path == Path::kOracle) {
    return absl::InvalidArgumentError("finite check: only reference and custom outputs are served");
  }
  const DevicePathOutput out = b.State(path);
  if (!out.ran) return NotRun(path);
  DeviceWorker& w = b.worker();
  Lane& lane = b.lane();
  const cudaStream_t s = PathStream(b, path);
  // The path's kernels ran on `s`: its output is complete in stream order.
  absl::Status st = w.Check(cudaMemsetAsync(lane.finite_device, 0, sizeof(unsigned), s), where);
  if (st.ok()) {
    st = w.Check(kernels::LaunchFlagNonFinite(static_cast<const uint16_t*>(out.o), b.o_elems(),
                                              out.lse, b.lse_elems(), lane.finite_device, s),
                 where);
  }
  if (st.ok()) {
    st = w.Check(cudaMemcpyAsync(lane.finite_host, lane.finite_device, sizeof(unsigned),
                                 cudaMemcpyDeviceToHost, s),
                 where);
  }
  if (st.ok()) st = w.Check(cudaEventRecord(lane.finite_done, s), where);
  if (path != Path::kReference) {
    if (absl::Status rec = b.RecordShadowUse(); st.ok()) st = rec;
  }
  return st;
}

// Queues, on the path's stream, one kernel that copies a path's output (reference or custom) into
// registered device memory and checks it is finite as it goes, leaving the flag in the lane's
// mapped host word. The caller holds lane.finite_mu until it has read the flag.
absl::Status EnqueueCheckedCopy(CudaPreparedBundle& b, Path path, const RegionRange& o,
                                const RegionRange* lse, const std::string& where)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(b.lane().finite_mu) {
  VERIFYD_ASSIGN_OR_RETURN(const DevicePathOutput out, DeliverableOutput(b, path, o, lse));
  DeviceWorker& w = b.worker();
  Lane& lane = b.lane();
  // The lane's last check was read before finite_mu was let go: nothing writes the word now.
  *lane.finite_host = 0;
  absl::Status st = w.Check(
      kernels::LaunchFlagNonFiniteAndCopy(
          static_cast<const uint16_t*>(out.o), reinterpret_cast<uint16_t*>(o.data), b.o_elems(),
          out.lse, lse != nullptr ? reinterpret_cast<float*>(lse->data) : nullptr, b.lse_elems(),
          lane.finite_mapped, PathStream(b, path)),
      where);
  if (path != Path::kReference) {
    if (absl::Status rec = b.RecordShadowUse(); st.ok()) st = rec;
  }
  return st;
}

}  // namespace

int VisibleCudaDevices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

CudaEngine::CudaEngine(const CudaEngineOptions& options) : options_(options) {}

CudaEngine::~CudaEngine() = default;

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const CudaEngineOptions& options) {
  const int visible = VisibleCudaDevices();
  if (visible == 0) return absl::FailedPreconditionError("cuda engine: no CUDA device is visible");
  std::vector<int> devices = options.devices;
  if (devices.empty()) {
    for (int d = 0; d < visible; ++d) devices.push_back(d);
  }
  std::unique_ptr<CudaEngine> engine(new CudaEngine(options));
  for (int d : devices) {
    if (d < 0 || d >= visible) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: ", d, " is outside the visible [0, ", visible, ")"));
    }
    VERIFYD_ASSIGN_OR_RETURN(
        auto worker, DeviceWorker::Create(d, options.memory_pool_bytes, options.lanes_per_device,
                                          options.sync_spin));
    engine->workers_.push_back(std::move(worker));
  }
  return engine;
}

EngineInfo CudaEngine::Info() const {
  EngineInfo info;
  info.engine = "cuda";
  const cudaDeviceProp& p = workers_.front()->props();
  info.device = p.name;
  if (workers_.size() > 1) absl::StrAppend(&info.device, " x", workers_.size());
  info.sm_count = p.multiProcessorCount;
  info.compute_capability = absl::StrCat(p.major, ".", p.minor);
  // The planner's choice of tiles (kernels/custom/custom_attention.cu, Resolve).
  const bool small = options_.custom.small_smem ||
                     p.sharedMemPerBlockOptin < kernels::HopperTileShape().smem_bytes;
  info.custom_tile_tokens =
      small ? kernels::Sm120TileShape().tokens : kernels::HopperTileShape().tokens;
  return info;
}

absl::StatusOr<std::shared_ptr<PreparedBundle>> CudaEngine::Prepare(const BundleView& bundle,
                                                                    bool detach) {
  // A bundle in a CUDA IPC region runs on that region's device; others take turns.
  int device = bundle.q_device >= 0 ? bundle.q_device : bundle.kv_pool_device;
  if (device < 0) {
    const unsigned i = next_device_.fetch_add(1, std::memory_order_relaxed);
    device = static_cast<int>(i % workers_.size());
  }
  return PrepareOn(device, bundle, detach);
}

absl::StatusOr<std::shared_ptr<PreparedBundle>> CudaEngine::PrepareOn(int device_index,
                                                                      const BundleView& bundle,
                                                                      bool detach) {
  if (device_index < 0 || device_index >= num_devices()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: index ", device_index, " is outside [0, ", num_devices(), ")"));
  }
  if (std::string why = kernels::CheckShape(bundle.shape); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  if (bundle.q == nullptr || bundle.kv_pool == nullptr || bundle.kv_indptr == nullptr ||
      (bundle.shape.num_indices > 0 && bundle.kv_indices == nullptr) || bundle.kv_lens == nullptr ||
      bundle.tree_mask == nullptr) {
    return absl::InvalidArgumentError("bundle: a tensor is missing (null view)");
  }
  if (bundle.max_kv_len < bundle.shape.draft || bundle.total_kv_len < bundle.max_kv_len) {
    return absl::InvalidArgumentError(
        "bundle: max_kv_len/total_kv_len are not filled in (the bundle was not validated)");
  }
  for (int d : {bundle.q_device, bundle.kv_pool_device, bundle.indices_device}) {
    if (d >= 0 && d != device_index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: the bundle's CUDA IPC tensors are on device ", d, ", not ", device_index));
    }
  }
  // Page ids checked on the device are checked as they are copied for a pool read there.
  if (bundle.indices_device >= 0 && bundle.kv_pool_device < 0) {
    return absl::InvalidArgumentError(
        "kv_indices: in device memory while kv_pool is not (both or neither)");
  }
  DeviceWorker& w = *workers_[device_index];
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  auto b = std::make_shared<CudaPreparedBundle>(w, w.NextLane(), bundle);
  VERIFYD_RETURN_IF_ERROR(b->Upload(bundle, detach));
  return b;
}

absl::StatusOr<std::shared_ptr<const OwnedBundle>> CudaEngine::FetchInputs(PreparedBundle& pb) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const kernels::VerifyProblem& p = b.sent();  // an e4m3 pool as e4m3
  BundleView v;
  v.shape = p.shape;
  v.sm_scale = p.sm_scale;
  v.kv_scale = b.kv_scale();
  v.max_kv_len = p.max_kv_len;
  v.total_kv_len = p.total_kv_len;
  // A pool read in place is the client's whole pool: the capture takes the named pages only.
  if (b.pool_in_place()) v.shape.num_pages = p.shape.num_indices;
  auto owned = std::make_shared<OwnedBundle>(v, OwnedBundle::Sized{});
  const BundleView& o = owned->view();
  const cudaStream_t s = b.lane().shadow;
  const char* where = "fetching the bundle's inputs";
  VERIFYD_RETURN_IF_ERROR(b.AwaitInputsOn(s, where));
  const void* pool = p.kv_pool;
  ScopedWorkspace gathered(s);
  if (b.pool_in_place()) {
    VERIFYD_RETURN_IF_ERROR(gathered.Allocate(w, o.kv_bytes(), where));
    VERIFYD_RETURN_IF_ERROR(
        w.Check(kernels::LaunchGatherPages(p.kv_pool, p.kv_indices, p.shape.num_indices,
                                           o.page_bytes(), gathered.get(), s),
                where));
    pool = gathered.get();
  }
  auto d2h = [&](void* dst, const void* src, size_t bytes) {
    return bytes == 0 ? absl::OkStatus()
                      : w.Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), where);
  };
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_q(), p.q, o.q_elems() * 2));
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_kv_pool(), pool, o.kv_bytes()));
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_kv_indptr(), p.kv_indptr, (o.shape.batch + 1) * 4));
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_kv_indices(), p.kv_indices, o.shape.num_indices * 4));
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_kv_lens(), p.kv_lens, o.shape.batch * 4));
  VERIFYD_RETURN_IF_ERROR(d2h(owned->mutable_tree_mask(), p.tree_mask, o.mask_bytes()));
  VERIFYD_RETURN_IF_ERROR(b.RecordShadowUse());
  VERIFYD_RETURN_IF_ERROR(w.Check(cudaStreamSynchronize(s), where));
  if (b.pool_in_place()) {
    for (int64_t i = 0; i < o.shape.num_indices; ++i) {
      owned->mutable_kv_indices()[i] = static_cast<int32_t>(i);
    }
  }
  return std::shared_ptr<const OwnedBundle>(std::move(owned));
}

absl::StatusOr<std::unique_ptr<MappedRegion>> CudaEngine::OpenCudaIpc(int device,
                                                                      const std::string& handle,
                                                                      uint64_t byte_size) {
  if (device < 0 || device >= num_devices()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: index ", device, " is outside [0, ", num_devices(), ")"));
  }
  return OpenCudaIpcMapping(*workers_[device], device, handle, byte_size);
}

absl::StatusOr<std::unique_ptr<MappedRegion>> CudaEngine::ImportCudaVmm(
    int device, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
    uint64_t offset, uint64_t byte_size) {
  if (device < 0 || device >= num_devices()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: index ", device, " is outside [0, ", num_devices(), ")"));
  }
  return ImportCudaVmmMapping(*workers_[device], device, fds, chunk_bytes, offset, byte_size);
}

absl::StatusOr<std::function<void()>> CudaEngine::PinHostMemory(void* base, uint64_t bytes) {
  DeviceWorker& w = *workers_.front();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const cudaError_t e =
      cudaHostRegister(base, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  return std::function<void()>([&w, base] {
    if (w.Activate().ok()) cudaHostUnregister(base);
    cudaGetLastError();
  });
}

absl::Status CudaEngine::ZeroFill(const RegionRange& r) {
  if (r.device() < 0) return Engine::ZeroFill(r);
  if (r.device() >= num_devices()) {
    return absl::InternalError(absl::StrCat("o_out: a region on device ", r.device()));
  }
  DeviceWorker& w = *workers_[r.device()];
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const cudaStream_t s = w.NextLane().served;
  VERIFYD_RETURN_IF_ERROR(
      w.Check(cudaMemsetAsync(r.data, 0, r.byte_size, s), "zero-filling a failed call's output"));
  return w.AwaitCritical(s, "zero-filling a failed call's output");
}

absl::Status CudaEngine::ReadRange(const RegionRange& r, void* dst) {
  if (r.device() < 0) return Engine::ReadRange(r, dst);
  if (r.device() >= num_devices()) {
    return absl::InternalError(absl::StrCat("a region on device ", r.device()));
  }
  DeviceWorker& w = *workers_[r.device()];
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const cudaStream_t s = w.NextLane().served;
  VERIFYD_RETURN_IF_ERROR(w.Check(
      cudaMemcpyAsync(dst, r.data, r.byte_size, cudaMemcpyDeviceToHost, s), "reading a region"));
  return w.AwaitCritical(s, "reading a region");
}

absl::Status CudaEngine::WriteRange(const RegionRange& r, const void* src) {
  if (r.device() < 0) return Engine::WriteRange(r, src);
  if (r.device() >= num_devices()) {
    return absl::InternalError(absl::StrCat("a region on device ", r.device()));
  }
  DeviceWorker& w = *workers_[r.device()];
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const cudaStream_t s = w.NextLane().served;
  VERIFYD_RETURN_IF_ERROR(w.Check(
      cudaMemcpyAsync(r.data, src, r.byte_size, cudaMemcpyHostToDevice, s), "writing a region"));
  return w.AwaitCritical(s, "writing a region");
}

absl::Status CudaEngine::Deliver(Path path, PreparedBundle& pb, const RegionRange& o,
                                 const RegionRange* lse) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const std::string where = absl::StrCat(PathName(path), " path (writing its output in place)");
  VERIFYD_RETURN_IF_ERROR(EnqueueDeliver(b, path, o, lse, where));
  return w.AwaitCritical(PathStream(b, path), where);
}

absl::StatusOr<bool> CudaEngine::DeliverIfFinite(Path path, PreparedBundle& pb,
                                                 const RegionRange& o, const RegionRange* lse) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const std::string where =
      absl::StrCat(PathName(path), " path (checking its output is finite and writing it)");
  Lane& lane = b.lane();
  absl::MutexLock lock(&lane.finite_mu);
  // Into this GPU's own memory a kernel writes it (lse at float alignment, as regions give it:
  // kRegionAlign); elsewhere a copy does.
  const int here = w.device();
  if (o.device() == here && (lse == nullptr || (lse->device() == here &&
                                                reinterpret_cast<uintptr_t>(lse->data) % 4 == 0))) {
    VERIFYD_RETURN_IF_ERROR(EnqueueCheckedCopy(b, path, o, lse, where));
  } else {
    VERIFYD_RETURN_IF_ERROR(EnqueueFiniteCheck(b, path, where));
    VERIFYD_RETURN_IF_ERROR(EnqueueDeliver(b, path, o, lse, where));
  }
  // On the path's stream: one wait for the flag and the output.
  VERIFYD_RETURN_IF_ERROR(w.AwaitCritical(PathStream(b, path), where));
  return *lane.finite_host == 0;
}

absl::Status CudaEngine::Run(Path path, PreparedBundle& pb) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  VERIFYD_RETURN_IF_ERROR(b.worker().Activate());
  switch (path) {
    case Path::kReference:
      return RunReference(b);
    case Path::kCustom:
      return RunCustom(b, options_.custom, fault(), /*wait=*/true);
    case Path::kOracle:
      return RunOracle(b);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown path ", static_cast<int>(path)));
}

absl::Status CudaEngine::RunForCall(Path path, PreparedBundle& pb, const CallContext& call) {
  VERIFYD_RETURN_IF_ERROR(call.Check());
  if (path != Path::kCustom) return Run(path, pb);
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  VERIFYD_RETURN_IF_ERROR(b.worker().Activate());
  return RunCustom(b, options_.custom, fault(), /*wait=*/false);
}

absl::Status CudaEngine::RunCustomSplits(PreparedBundle& pb, int splits) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  VERIFYD_RETURN_IF_ERROR(b.worker().Activate());
  kernels::CustomConfig config = options_.custom;
  config.force_splits = splits;
  return RunCustom(b, config, fault(), /*wait=*/true);
}

absl::Status CudaEngine::Fetch(Path path, PreparedBundle& pb, PathOutput* out) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const DevicePathOutput st = b.State(path);
  if (!st.ran) return NotRun(path);
  const bool served = path == Path::kReference;
  const cudaStream_t s = served ? b.lane().served : b.lane().shadow;
  Staging& staging = served ? b.lane().output_served : b.lane().output_shadow;
  const std::string where = absl::StrCat(PathName(path), " path (fetching its output)");
  const size_t o_bytes = size_t(b.o_elems()) * (path == Path::kOracle ? 4 : 2);
  const size_t lse_bytes = size_t(b.lse_elems()) * 4;
  {
    absl::MutexLock lock(&staging.mu);
    VERIFYD_RETURN_IF_ERROR(w.Check(staging.buffer.Reserve(o_bytes + lse_bytes), where));
    char* host = staging.buffer.data();
    absl::Status copy =
        w.Check(cudaMemcpyAsync(host, st.o, o_bytes, cudaMemcpyDeviceToHost, s), where);
    if (copy.ok()) {
      copy = w.Check(cudaMemcpyAsync(host + o_bytes, st.lse, lse_bytes, cudaMemcpyDeviceToHost, s),
                     where);
    }
    if (copy.ok()) copy = w.Check(cudaEventRecord(staging.copied, s), where);
    if (!served) {
      if (absl::Status rec = b.RecordShadowUse(); copy.ok()) copy = rec;
    }
    VERIFYD_RETURN_IF_ERROR(copy);
    VERIFYD_RETURN_IF_ERROR(w.AwaitCritical(staging.copied, where));
    out->o.clear();
    out->o_f32.clear();
    if (path == Path::kOracle) {
      out->o_f32.resize(b.o_elems());
      std::memcpy(out->o_f32.data(), host, o_bytes);
    } else {
      out->o.resize(b.o_elems());
      std::memcpy(out->o.data(), host, o_bytes);
    }
    out->lse.resize(b.lse_elems());
    std::memcpy(out->lse.data(), host + o_bytes, lse_bytes);
  }
  VERIFYD_ASSIGN_OR_RETURN(out->seconds, PathSeconds(path, pb));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaEngine::PathSeconds(Path path, PreparedBundle& pb) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const DevicePathOutput st = b.State(path);
  if (!st.ran) return NotRun(path);
  const char* where = "path time";
  VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventSynchronize(st.done), where));
  float ms = 0;
  VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventElapsedTime(&ms, st.start, st.done), where));
  return ms * 1e-3;
}

absl::StatusOr<bool> CudaEngine::AllFinite(Path path, PreparedBundle& pb) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  const std::string where = absl::StrCat(PathName(path), " path (checking its output is finite)");
  Lane& lane = b.lane();
  absl::MutexLock lock(&lane.finite_mu);
  VERIFYD_RETURN_IF_ERROR(EnqueueFiniteCheck(b, path, where));
  // On the call's critical path when the custom path is served.
  VERIFYD_RETURN_IF_ERROR(w.AwaitCritical(lane.finite_done, where));
  return *lane.finite_host == 0;
}

absl::Status CudaEngine::InputChecks(PreparedBundle& pb) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  VERIFYD_RETURN_IF_ERROR(b.worker().Activate());
  return b.InputChecks();
}

absl::StatusOr<DiffStats> CudaEngine::Compare(PreparedBundle& pb, Path test, Path ref,
                                              const Tolerance& tol) {
  auto& b = static_cast<CudaPreparedBundle&>(pb);
  DeviceWorker& w = b.worker();
  VERIFYD_RETURN_IF_ERROR(w.Activate());
  if (test == Path::kOracle) {
    return absl::InvalidArgumentError("compare: the oracle can only be the reference side");
  }
  const DevicePathOutput t = b.State(test);
  if (!t.ran) return NotRun(test);
  const DevicePathOutput r = b.State(ref);
  if (!r.ran) return NotRun(ref);
  Lane& lane = b.lane();
  const cudaStream_t s = lane.shadow;
  const std::string where =
      absl::StrCat("comparing the ", PathName(test), " and ", PathName(ref), " outputs");
  absl::MutexLock lock(&lane.compare_mu);
  absl::Status st = w.Check(cudaStreamWaitEvent(s, t.done, 0), where);
  if (st.ok()) st = w.Check(cudaStreamWaitEvent(s, r.done, 0), where);
  if (st.ok()) {
    const kernels::DeviceValues tv{t.o, kernels::ElemType::kBf16};
    const kernels::DeviceValues rv{
        r.o, ref == Path::kOracle ? kernels::ElemType::kF32 : kernels::ElemType::kBf16};
    st = w.Check(kernels::LaunchCompare(tv, rv, b.o_elems(), t.lse, r.lse, b.lse_elems(),
                                        ToCompareLimits(tol), lane.compare_workspace,
                                        kernels::CompareWorkspaceBytes(), lane.compare_device, s),
                 where);
  }
  if (st.ok()) {
    st = w.Check(cudaMemcpyAsync(lane.compare_host, lane.compare_device,
                                 sizeof(kernels::DeviceDiffStats), cudaMemcpyDeviceToHost, s),
                 where);
  }
  if (st.ok()) st = w.Check(cudaEventRecord(lane.compare_done, s), where);
  if (absl::Status rec = b.RecordShadowUse(); st.ok()) st = rec;
  VERIFYD_RETURN_IF_ERROR(st);
  VERIFYD_RETURN_IF_ERROR(w.Check(cudaEventSynchronize(lane.compare_done), where));
  return ToDiffStats(*lane.compare_host);
}

void CudaEngine::SetDeviceLostHandler(DeviceLostHandler handler) {
  for (auto& w : workers_) w->SetLostHandler(handler);
}

void CudaEngine::InjectCustomFault(const CustomFault& fault) {
  absl::MutexLock lock(&fault_mu_);
  fault_ = fault;
}

CustomFault CudaEngine::fault() const {
  absl::MutexLock lock(&fault_mu_);
  return fault_;
}

std::unique_ptr<Engine> MakeCudaEngine(const CudaEngineOptions& options, absl::Status* error) {
  auto engine = CudaEngine::Create(options);
  if (!engine.ok()) {
    if (error != nullptr) *error = engine.status();
    return nullptr;
  }
  if (error != nullptr) *error = absl::OkStatus();
  return *std::move(engine);
}

}  // namespace verifyd
