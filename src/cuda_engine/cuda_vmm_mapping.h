#pragma once
// The chunks of a CUDA VMM allocation (cuMemCreate: torch's expandable segments) imported on one
// device worker from the POSIX file descriptors a client exported them to, and mapped whole, side
// by side, into one reserved address range: the GPU side of a registered cuda_ipc region that
// cudaIpcGetMemHandle could not export. Unmapped and released when destroyed.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/cuda_engine/device_worker.h"
#include "src/region/mapped_region.h"

namespace verifyd {

// Imports each of `fds` (borrowed) with cuMemImportFromShareableHandle on `worker`'s device,
// reserves the chunks' total, maps chunk i whole (chunk_bytes[i], a multiple of the allocation
// granularity) after the ones before it, and makes the range readable and writable by the
// device. The region starts `offset` bytes into the first chunk and has `byte_size` bytes (the
// caller checked that they fit). INVALID_ARGUMENT naming `chunks[i]` for a descriptor that does
// not import, a chunk on another device, or a size that is not the chunk's own (cuMemMap maps a
// chunk only whole).
absl::StatusOr<std::unique_ptr<MappedRegion>> ImportCudaVmmMapping(
    DeviceWorker& worker, int device_index, const std::vector<int>& fds,
    const std::vector<uint64_t>& chunk_bytes, uint64_t offset, uint64_t byte_size);

}  // namespace verifyd
