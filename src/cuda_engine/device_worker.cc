#include "src/cuda_engine/device_worker.h"

#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "src/cuda_engine/cuda_status.h"
#include "src/cuda_engine/device_layout.h"

namespace verifyd {
namespace {

absl::Status CublasStatus(cublasStatus_t st, absl::string_view where) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(where, ": cuBLAS error ", cublasGetStatusName(st)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceWorker>> DeviceWorker::Create(int device, size_t pool_bytes,
                                                                   int lanes,
                                                                   absl::Duration sync_spin) {
  std::unique_ptr<DeviceWorker> w(new DeviceWorker(device, sync_spin));
  if (absl::Status st = w->Init(pool_bytes, lanes); !st.ok()) return st;
  return w;
}

absl::Status DeviceWorker::Init(size_t pool_bytes, int lanes) {
  const std::string where = absl::StrCat("starting the CUDA worker for device ", device_);
  if (absl::Status st = Check(cudaSetDevice(device_), where); !st.ok()) return st;
  // Waits block instead of spinning: a sidecar must not burn the host cores that the serving
  // stack and gRPC encoding need (the shadow path's waits would otherwise spin one core each).
  // Only the wait for a call's served output polls first, for a bounded time (AwaitCritical).
  if (absl::Status st = Check(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync), where);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = Check(cudaGetDeviceProperties(&props_, device_), where); !st.ok()) {
    return st;
  }
  cudaMemPoolProps pp{};
  pp.allocType = cudaMemAllocationTypePinned;
  pp.location.type = cudaMemLocationTypeDevice;
  pp.location.id = device_;
  pp.maxSize = pool_bytes;  // 0: the driver's default, no cap of ours
  if (cudaMemPoolCreate(&pool_, &pp) != cudaSuccess) {
    // A driver without pool size caps: the release threshold below still bounds what is kept.
    cudaGetLastError();
    pp.maxSize = 0;
    if (absl::Status st = Check(cudaMemPoolCreate(&pool_, &pp), where); !st.ok()) return st;
  }
  // Keep up to pool_bytes cached between calls: later allocations are served from the pool.
  uint64_t keep = pool_bytes > 0 ? pool_bytes : ~uint64_t{0};
  if (absl::Status st =
          Check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), where);
      !st.ok()) {
    return st;
  }
  // The served stream runs what calls wait for (the inputs' copies, the reference path) at the
  // device's highest priority, the shadow stream (the deferred path, the comparisons) at its
  // lowest: deferred work yields the SMs it frees to the next call's served kernels.
  int least = 0, greatest = 0;
  if (absl::Status st = Check(cudaDeviceGetStreamPriorityRange(&least, &greatest), where);
      !st.ok()) {
    return st;
  }
  // Bundles between their upload and their call's answer: a few per lane at most.
  if (absl::Status st = Check(check_slots_.Init(256), where); !st.ok()) return st;
  for (int i = 0; i < std::max(lanes, 1); ++i) {
    auto lane = std::make_unique<Lane>();
    Lane& l = *lane;
    l.layouts = std::make_unique<LayoutCache>();
    lanes_.push_back(std::move(lane));  // owned from here on, so the destructor frees it
    absl::Status st =
        Check(cudaStreamCreateWithPriority(&l.served, cudaStreamNonBlocking, greatest), where);
    if (st.ok()) {
      st = Check(cudaStreamCreateWithPriority(&l.shadow, cudaStreamNonBlocking, least), where);
    }
    for (cudaEvent_t* e : {&l.input.copied, &l.output_served.copied, &l.output_shadow.copied,
                           &l.compare_done, &l.finite_done}) {
      if (st.ok()) st = Check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), where);
    }
    absl::MutexLock blas_lock(&l.blas_mu);
    absl::MutexLock compare_lock(&l.compare_mu);
    absl::MutexLock finite_lock(&l.finite_mu);
    if (st.ok()) st = CublasStatus(cublasCreate(&l.blas), where);
    if (st.ok()) {
      st = Check(cudaMalloc(&l.compare_workspace, kernels::CompareWorkspaceBytes()), where);
    }
    if (st.ok()) {
      st = Check(
          cudaMalloc(reinterpret_cast<void**>(&l.compare_device), sizeof(kernels::DeviceDiffStats)),
          where);
    }
    if (st.ok()) {
      st = Check(cudaHostAlloc(reinterpret_cast<void**>(&l.compare_host),
                               sizeof(kernels::DeviceDiffStats), cudaHostAllocDefault),
                 where);
    }
    if (st.ok()) {
      st = Check(cudaMalloc(reinterpret_cast<void**>(&l.finite_device), sizeof(unsigned)), where);
    }
    if (st.ok()) {
      st = Check(cudaHostAlloc(reinterpret_cast<void**>(&l.finite_host), sizeof(unsigned),
                               cudaHostAllocMapped),
                 where);
    }
    if (st.ok()) {
      st = Check(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&l.finite_mapped), l.finite_host, 0),
          where);
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

DeviceWorker::DeviceWorker(int device, absl::Duration sync_spin)
    : device_(device), sync_spin_(sync_spin) {}

DeviceWorker::~DeviceWorker() {
  cudaSetDevice(device_);
  for (auto& lane : lanes_) {
    Lane& l = *lane;
    if (l.served != nullptr) cudaStreamSynchronize(l.served);
    if (l.shadow != nullptr) cudaStreamSynchronize(l.shadow);
    if (l.layouts != nullptr) l.layouts->Clear();  // frees on l.served
    {
      absl::MutexLock lock(&l.blas_mu);
      if (l.blas != nullptr) cublasDestroy(l.blas);
    }
    {
      absl::MutexLock lock(&l.compare_mu);
      if (l.compare_workspace != nullptr) cudaFree(l.compare_workspace);
      if (l.compare_device != nullptr) cudaFree(l.compare_device);
      if (l.compare_host != nullptr) cudaFreeHost(l.compare_host);
    }
    {
      absl::MutexLock lock(&l.finite_mu);
      if (l.finite_device != nullptr) cudaFree(l.finite_device);
      if (l.finite_host != nullptr) cudaFreeHost(l.finite_host);
    }
    for (cudaEvent_t e : {l.input.copied, l.output_served.copied, l.output_shadow.copied,
                          l.compare_done, l.finite_done}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (l.served != nullptr) cudaStreamDestroy(l.served);
    if (l.shadow != nullptr) cudaStreamDestroy(l.shadow);
  }
  lanes_.clear();
  if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
  cudaGetLastError();  // nothing to report from a destructor
}

Lane& DeviceWorker::NextLane() {
  return *lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size()];
}

absl::Status DeviceWorker::Activate() {
  if (lost_.load(std::memory_order_acquire)) {
    absl::MutexLock lock(&lost_mu_);
    return absl::DataLossError(lost_reason_);
  }
  return Check(cudaSetDevice(device_), "selecting the device");
}

void DeviceWorker::SetLostHandler(DeviceLostHandler handler) {
  absl::MutexLock lock(&lost_mu_);
  on_lost_ = std::move(handler);
}

absl::Status DeviceWorker::Check(cudaError_t e, absl::string_view where) {
  bool sticky = false;
  absl::Status st = CudaStatus(e, where, device_, &sticky);
  if (!sticky) return st;
  DeviceLostHandler report;
  {
    absl::MutexLock lock(&lost_mu_);
    if (!lost_.load(std::memory_order_relaxed)) {
      lost_reason_ = std::string(st.message());
      lost_.store(true, std::memory_order_release);
      report = on_lost_;
    }
  }
  if (report) report(st);
  return st;
}

namespace {

// Polls `query` until it stops answering cudaErrorNotReady: back to back for `spin`, then
// between naps that grow with the time waited (a 32nd of it, 2 to 50 us), so that a wait of t
// ends within about t/32 of the GPU being done without keeping a core busy; past kNapFor, or with
// no spin at all, `block` sleeps in the driver, which wakes tens of microseconds after the GPU.
template <typename Query, typename Block>
cudaError_t PollThenBlock(absl::Duration spin, Query query, Block block) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kNapFor = std::chrono::milliseconds(50);
  constexpr auto kFirstNap = std::chrono::microseconds(2),
                 kLongestNap = std::chrono::microseconds(50);
  if (spin <= absl::ZeroDuration()) return block();
  const auto start = Clock::now();
  const auto end = start + absl::ToChronoNanoseconds(spin);
  while (Clock::now() < end) {
    const cudaError_t e = query();
    if (e != cudaErrorNotReady) return e;
  }
  // Naps of a few microseconds would otherwise last 50 us more: the default timer slack.
  thread_local bool slack_set = false;
  if (!slack_set) {
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    slack_set = true;
  }
  for (auto now = Clock::now(); now - start < kNapFor; now = Clock::now()) {
    const auto nap = std::clamp<Clock::duration>((now - start) / 32, kFirstNap, kLongestNap);
    std::this_thread::sleep_for(nap);
    const cudaError_t e = query();
    if (e != cudaErrorNotReady) return e;
  }
  return block();
}

}  // namespace

absl::Status DeviceWorker::AwaitCritical(cudaStream_t s, absl::string_view where) {
  return Check(
      PollThenBlock(
          sync_spin_, [s] { return cudaStreamQuery(s); }, [s] { return cudaStreamSynchronize(s); }),
      where);
}

absl::Status DeviceWorker::AwaitCritical(cudaEvent_t e, absl::string_view where) {
  return Check(
      PollThenBlock(
          sync_spin_, [e] { return cudaEventQuery(e); }, [e] { return cudaEventSynchronize(e); }),
      where);
}

}  // namespace verifyd
