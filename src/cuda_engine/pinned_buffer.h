#pragma once
// Page-locked host memory that grows on demand and is reused across calls, so that the
// host<->device copies are true DMA and no call pays for pinning after warm-up.

#include <cuda_runtime.h>

#include <cstddef>

namespace verifyd {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  // Makes capacity() >= bytes; the old contents are dropped when it grows.
  cudaError_t Reserve(size_t bytes);
  char* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace verifyd
