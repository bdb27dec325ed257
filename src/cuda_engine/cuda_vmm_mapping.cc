#include "src/cuda_engine/cuda_vmm_mapping.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

// The driver's VMM calls, found at run time (the engine links only the runtime).
struct VmmDriver {
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuGetErrorString) error_string = nullptr;
  bool ok = false;
};

template <typename Fn>
bool Find(const char* name, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

const VmmDriver& Driver() {
  static const VmmDriver d = [] {
    VmmDriver v;
    v.ok = Find("cuMemImportFromShareableHandle", &v.import_handle) &&
           Find("cuMemGetAllocationPropertiesFromHandle", &v.properties) &&
           Find("cuMemGetAllocationGranularity", &v.granularity) &&
           Find("cuMemAddressReserve", &v.reserve) && Find("cuMemAddressFree", &v.address_free) &&
           Find("cuMemMap", &v.map) && Find("cuMemUnmap", &v.unmap) &&
           Find("cuMemSetAccess", &v.set_access) && Find("cuMemRelease", &v.release) &&
           Find("cuGetErrorString", &v.error_string);
    return v;
  }();
  return d;
}

std::string ErrorText(const VmmDriver& d, const char* call, CUresult r) {
  const char* s = nullptr;
  if (d.error_string(r, &s) != CUDA_SUCCESS || s == nullptr) s = "unknown error";
  return absl::StrCat(call, " failed: ", s, " (", static_cast<int>(r), ")");
}

class CudaVmmMapping final : public MappedRegion {
 public:
  CudaVmmMapping(DeviceWorker& worker, int device_index)
      : worker_(worker), device_index_(device_index) {}
  ~CudaVmmMapping() override {
    const VmmDriver& d = Driver();
    if (!worker_.Activate().ok()) return;
    for (const Chunk& c : chunks_) {
      if (c.mapped) d.unmap(reserved_ + c.at, c.bytes);
      d.release(c.handle);
    }
    if (reserved_ != 0) d.address_free(reserved_, reserved_bytes_);
    cudaGetLastError();
  }
  char* base() const override { return reinterpret_cast<char*>(reserved_ + offset_); }
  uint64_t byte_size() const override { return byte_size_; }
  int device() const override { return device_index_; }
  absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const override {
    if (absl::Status st = worker_.Activate(); !st.ok()) return st;
    return worker_.Check(cudaMemcpy(dst, base() + offset, bytes, cudaMemcpyDeviceToHost),
                         "reading a CUDA VMM region");
  }

  absl::Status Import(const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
                      uint64_t offset, uint64_t byte_size);

 private:
  struct Chunk {
    CUmemGenericAllocationHandle handle = 0;
    uint64_t at = 0;  // from reserved_
    uint64_t bytes = 0;
    bool mapped = false;
  };
  DeviceWorker& worker_;
  const int device_index_;
  std::vector<Chunk> chunks_;
  CUdeviceptr reserved_ = 0;
  uint64_t reserved_bytes_ = 0;
  uint64_t offset_ = 0;
  uint64_t byte_size_ = 0;
};

absl::Status CudaVmmMapping::Import(const std::vector<int>& fds,
                                    const std::vector<uint64_t>& chunk_bytes, uint64_t offset,
                                    uint64_t byte_size) {
  const VmmDriver& d = Driver();
  const int cuda_device = worker_.device();
  uint64_t at = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    Chunk c;
    CUresult r = d.import_handle(&c.handle, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i])),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunks[", i, "]: ", ErrorText(d, "cuMemImportFromShareableHandle", r),
                       " (a descriptor from cuMemExportToShareableHandle with "
                       "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)"));
    }
    c.at = at;
    c.bytes = chunk_bytes[i];
    chunks_.push_back(c);
    CUmemAllocationProp prop{};
    if ((r = d.properties(&prop, c.handle)) != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunks[", i, "]: ", ErrorText(d, "cuMemGetAllocationPropertiesFromHandle", r)));
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != cuda_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunks[", i, "]: lives on CUDA device ", prop.location.id, ", not on device ",
          device_index_, " (CUDA device ", cuda_device, ") that the request names"));
    }
    size_t granularity = 0;
    if ((r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) !=
            CUDA_SUCCESS ||
        granularity == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunks[", i, "]: ", ErrorText(d, "cuMemGetAllocationGranularity", r)));
    }
    if (c.bytes % granularity != 0) {
      return absl::InvalidArgumentError(absl::StrCat("chunks[", i, "]: ", c.bytes,
                                                     " bytes is not a multiple of the "
                                                     "allocation granularity (",
                                                     granularity, " bytes)"));
    }
    at += c.bytes;
  }
  reserved_bytes_ = at;
  if (CUresult r = d.reserve(&reserved_, reserved_bytes_, 0, 0, 0); r != CUDA_SUCCESS) {
    reserved_ = 0;
    return absl::ResourceExhaustedError(absl::StrCat(
        "chunks: ", ErrorText(d, "cuMemAddressReserve", r), " for ", reserved_bytes_, " bytes"));
  }
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& c = chunks_[i];
    if (CUresult r = d.map(reserved_ + c.at, c.bytes, 0, c.handle, 0); r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunks[", i, "]: ", ErrorText(d, "cuMemMap", r), " for ", c.bytes,
                       " bytes (a chunk is mapped whole: its size must be the allocation's own)"));
    }
    c.mapped = true;
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = cuda_device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = d.set_access(reserved_, reserved_bytes_, &access, 1); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat("chunks: ", ErrorText(d, "cuMemSetAccess", r)));
  }
  offset_ = offset;
  byte_size_ = byte_size;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedRegion>> ImportCudaVmmMapping(
    DeviceWorker& worker, int device_index, const std::vector<int>& fds,
    const std::vector<uint64_t>& chunk_bytes, uint64_t offset, uint64_t byte_size) {
  if (!Driver().ok) {
    return absl::FailedPreconditionError(
        "chunks: the CUDA driver does not offer the VMM calls (cuMemImportFromShareableHandle, "
        "cuMemMap, ...); a CUDA 12 driver does");
  }
  if (absl::Status st = worker.Activate(); !st.ok()) return st;
  auto m = std::make_unique<CudaVmmMapping>(worker, device_index);
  // A chunk that fails leaves the ones before it to the destructor.
  if (absl::Status st = m->Import(fds, chunk_bytes, offset, byte_size); !st.ok()) return st;
  return std::unique_ptr<MappedRegion>(std::move(m));
}

}  // namespace verifyd
