#include "kernels/reference/input_check_kernels.h"

namespace verifyd::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 264;  // two per SM of an H200: the tensors are small

// The lowest position wins atomicMin, and its value rides along in the low half.
__device__ __forceinline__ unsigned long long Entry(int64_t position, uint32_t value) {
  return static_cast<unsigned long long>(position) << 32 | value;
}

__global__ void __launch_bounds__(kThreads)
    CheckedInputCopyKernel(const int32_t* indices, int64_t n, int64_t num_pages,
                           int32_t* indices_out, const uint8_t* mask, int64_t mask_bytes,
                           int row_bytes, uint8_t pad_bits, bool bytes_format, uint8_t* mask_out,
                           InputCheckStatus* status) {
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  for (int64_t i = first; i < n; i += stride) {
    const int32_t page = indices[i];
    const bool ok = page >= 0 && page < num_pages;
    indices_out[i] = ok ? page : 0;
    if (!ok) atomicMin(&status->bad_index, Entry(i, static_cast<uint32_t>(page)));
  }
  for (int64_t i = first; i < mask_bytes; i += stride) {
    const uint8_t byte = mask[i];
    mask_out[i] = byte;
    const bool bad =
        bytes_format ? byte > 1 : (i % row_bytes == row_bytes - 1 && (byte & pad_bits) != 0);
    if (bad) atomicMin(&status->bad_mask, Entry(i, byte));
  }
}

}  // namespace

cudaError_t LaunchCheckedInputCopy(const int32_t* indices, int64_t n, int64_t num_pages,
                                   int32_t* indices_out, const uint8_t* mask, int64_t mask_bytes,
                                   MaskFormat format, int draft, uint8_t* mask_out,
                                   InputCheckStatus* status, cudaStream_t stream) {
  if (n < 0 || mask_bytes < 0 || n >= (int64_t{1} << 32) || mask_bytes >= (int64_t{1} << 32) ||
      draft < 1) {
    return cudaErrorInvalidValue;
  }
  const int64_t work = n > mask_bytes ? n : mask_bytes;
  if (work == 0) return cudaSuccess;
  const int64_t want = (work + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want > kMaxBlocks ? kMaxBlocks : want);
  const bool bytes_format = format == MaskFormat::kBytes;
  // A packed row's bits past T: the high bits of its last byte (none when T is a multiple of 8).
  const uint8_t pad = draft % 8 == 0 ? 0 : static_cast<uint8_t>(0xffu << (draft % 8));
  CheckedInputCopyKernel<<<blocks, kThreads, 0, stream>>>(
      indices, n, num_pages, indices_out, mask, mask_bytes,
      static_cast<int>(MaskRowBytes(format, draft)), pad, bytes_format, mask_out, status);
  return cudaGetLastError();
}

}  // namespace verifyd::kernels
