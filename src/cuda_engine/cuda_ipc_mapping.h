#pragma once
// A CUDA IPC memory handle opened on one device worker: the GPU side of a registered cuda_ipc
// region. Closed (cudaIpcCloseMemHandle) when destroyed.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/cuda_engine/device_worker.h"
#include "src/region/mapped_region.h"

namespace verifyd {

// Opens `handle` (the 64 bytes of a cudaIpcMemHandle_t) on `worker`'s device. INVALID_ARGUMENT
// naming the field for a handle that does not open, or a byte_size past the end of the
// allocation it names.
absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpcMapping(DeviceWorker& worker,
                                                                 int device_index,
                                                                 const std::string& handle,
                                                                 uint64_t byte_size);

}  // namespace verifyd
