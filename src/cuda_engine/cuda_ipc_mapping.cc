#include "src/cuda_engine/cuda_ipc_mapping.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

class CudaIpcMapping final : public MappedRegion {
 public:
  CudaIpcMapping(DeviceWorker& worker, int device_index, void* base, uint64_t byte_size)
      : worker_(worker), device_index_(device_index), base_(base), byte_size_(byte_size) {}
  ~CudaIpcMapping() override {
    if (worker_.Activate().ok()) cudaIpcCloseMemHandle(base_);
    cudaGetLastError();
  }
  char* base() const override { return static_cast<char*>(base_); }
  uint64_t byte_size() const override { return byte_size_; }
  int device() const override { return device_index_; }
  absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const override {
    if (absl::Status st = worker_.Activate(); !st.ok()) return st;
    return worker_.Check(cudaMemcpy(dst, base() + offset, bytes, cudaMemcpyDeviceToHost),
                         "reading a CUDA IPC region");
  }

 private:
  DeviceWorker& worker_;
  int device_index_;
  void* base_;
  uint64_t byte_size_;
};

// The size of the allocation `p` starts, through the driver's cuMemGetAddressRange (found at run
// time: the engine links only the runtime). 0 when it cannot be known.
uint64_t AllocationBytesFrom(void* p) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return 0;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (reinterpret_cast<Fn>(fn)(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return 0;
  }
  return static_cast<uint64_t>(base + size - reinterpret_cast<CUdeviceptr>(p));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpcMapping(DeviceWorker& worker,
                                                                 int device_index,
                                                                 const std::string& handle,
                                                                 uint64_t byte_size) {
  if (absl::Status st = worker.Activate(); !st.ok()) return st;
  cudaIpcMemHandle_t h;
  static_assert(sizeof h == 64);
  std::memcpy(&h, handle.data(), sizeof h);
  void* base = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: the handle was bad, the context is fine
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_handle: cudaIpcOpenMemHandle on device ", device_index,
        " failed: ", cudaGetErrorString(e),
        " (a handle from cudaIpcGetMemHandle in another live process on the same GPU)"));
  }
  const uint64_t available = AllocationBytesFrom(base);
  if (available == 0 || byte_size > available) {
    cudaIpcCloseMemHandle(base);
    return absl::InvalidArgumentError(
        available == 0
            ? std::string("byte_size: the size of the allocation behind ipc_handle is unknown")
            : absl::StrCat("byte_size: ", byte_size,
                           " bytes is past the end of the allocation "
                           "behind ipc_handle (",
                           available, " bytes)"));
  }
  return std::unique_ptr<MappedRegion>(new CudaIpcMapping(worker, device_index, base, byte_size));
}

}  // namespace verifyd
