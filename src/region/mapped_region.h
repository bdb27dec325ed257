#pragma once
// A registered region's memory as verifyd maps it: host memory (a POSIX shared-memory object)
// or one GPU's memory (a CUDA IPC handle opened on that GPU). Unmapped when destroyed.

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/status/status.h"

namespace verifyd {

class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  // The first byte calls may name (offset 0).
  virtual char* base() const = 0;
  virtual uint64_t byte_size() const = 0;
  // The GPU the memory is on; -1 for host memory.
  virtual int device() const = 0;
  bool on_device() const { return device() >= 0; }
  // False once the memory was lost under the mapping (a client shrank its shm object): what was
  // read from it since is zeros, not the client's bytes.
  virtual bool intact() const { return true; }
  // Copies [offset, offset + bytes) into host memory `dst` (a device-to-host copy on a GPU).
  // The caller checked the range.
  virtual absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const = 0;
  // Runs before the memory is unmapped (undoes what was done to it after mapping, e.g. pinning).
  void SetBeforeUnmap(std::function<void()> f) { before_unmap_ = std::move(f); }

 protected:
  // Subclasses call it first in their destructor.
  void RunBeforeUnmap() {
    if (before_unmap_) before_unmap_();
    before_unmap_ = nullptr;
  }

 private:
  std::function<void()> before_unmap_;
};

}  // namespace verifyd
