#pragma once
// POSIX shared memory mapped read-write: the host side of a registered shm region.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "src/region/mapped_region.h"

namespace verifyd {

// Opens the shared-memory object `key` (shm_open) and maps [offset, offset + byte_size) of it
// read-write. NOT_FOUND when there is no such object; INVALID_ARGUMENT naming the field when the
// range does not lie inside it. With `caller_uid` (the kernel-verified uid of the client asking)
// the object must belong to that uid, or the caller be root: PERMISSION_DENIED naming `key`
// otherwise, so that a client cannot have verifyd read or write another user's memory.
absl::StatusOr<std::unique_ptr<MappedRegion>> MapShm(const std::string& key, uint64_t offset,
                                                     uint64_t byte_size,
                                                     std::optional<uint32_t> caller_uid);

}  // namespace verifyd
