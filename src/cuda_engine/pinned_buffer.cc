#include "src/cuda_engine/pinned_buffer.h"

namespace verifyd {
namespace {

constexpr size_t kMinBytes = size_t{1} << 20;

}  // namespace

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

cudaError_t PinnedBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return cudaSuccess;
  // Powers of two: a stream of slightly growing bundles re-pins only a few times.
  size_t want = kMinBytes;
  while (want < bytes) want *= 2;
  if (data_ != nullptr) cudaFreeHost(data_);
  data_ = nullptr;
  capacity_ = 0;
  void* p = nullptr;
  if (cudaError_t e = cudaHostAlloc(&p, want, cudaHostAllocDefault); e != cudaSuccess) return e;
  data_ = static_cast<char*>(p);
  capacity_ = want;
  return cudaSuccess;
}

}  // namespace verifyd
