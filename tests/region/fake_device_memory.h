#pragma once
// What the registry's unit suites open in place of a GPU allocation: host memory, counted while
// it lives, and the 64-byte CUDA IPC handles that name it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/region/mapped_region.h"

namespace verifyd {

// Host memory posing as a GPU allocation; counts the live ones.
class FakeDeviceMemory final : public MappedRegion {
 public:
  FakeDeviceMemory(int device, uint64_t bytes, int* live)
      : device_(device), mem_(bytes), live_(live) {
    ++*live_;
  }
  ~FakeDeviceMemory() override { --*live_; }
  char* base() const override { return const_cast<char*>(mem_.data()); }
  uint64_t byte_size() const override { return mem_.size(); }
  int device() const override { return device_; }
  absl::Status ReadToHost(uint64_t, uint64_t, void*) const override { return absl::OkStatus(); }

 private:
  int device_;
  std::vector<char> mem_;
  int* live_;
};

// The 64-byte CUDA IPC handle number `i` (0 to 9).
inline std::string Handle(int i) { return std::string(63, 'h') + static_cast<char>('0' + i); }

}  // namespace verifyd
