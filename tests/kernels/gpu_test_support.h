#pragma once
// Test support for the GPU kernel suites: skip without a GPU, device buffers with guard bytes,
// a bundle uploaded as a VerifyProblem with poisoned outputs, and the one error limit the
// kernel is held to against the fp64 oracle.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/verify_problem.h"
#include "src/bundle/bundle.h"

namespace verifyd::testing {

// The kernel against the fp64 oracle rounded to bf16, over every checked row:
// rel-L2 = ||o - ref|| / ||ref||, max-abs = max |o - ref| (bf16 ulp at |x| in [2, 4) is 0.0156),
// lse within 1e-3 (natural log, fp32), -inf exactly where the oracle has -inf. NaN fails.
inline constexpr double kKernelMaxRelL2 = 5e-3;
inline constexpr double kKernelMaxAbs = 3e-2;
inline constexpr double kKernelMaxLseAbs = 1e-3;

// Why the GPU suites skip, or "" when a device is usable.
inline std::string NoGpuReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    return std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
  }
  if (n == 0) return "no CUDA device present";
  return "";
}

inline constexpr size_t kGuardBytes = 256;
inline constexpr uint8_t kGuardByte = 0xA5;

// cudaMalloc'd bytes followed by kGuardBytes of kGuardByte.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { Reset(bytes); }
  ~DeviceBuffer() { Free(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  cudaError_t Reset(size_t bytes) {
    Free();
    bytes_ = bytes;
    cudaError_t e = cudaMalloc(&ptr_, bytes + kGuardBytes);
    if (e != cudaSuccess) {
      ptr_ = nullptr;
      return e;
    }
    return cudaMemset(static_cast<char*>(ptr_) + bytes, kGuardByte, kGuardBytes);
  }
  template <typename T>
  cudaError_t Upload(const std::vector<T>& v) {
    if (v.empty()) return cudaSuccess;
    return cudaMemcpy(ptr_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t Fill(uint8_t byte) { return cudaMemset(ptr_, byte, bytes_); }
  // True when the guard bytes after the buffer are untouched.
  bool GuardIntact() const {
    std::vector<uint8_t> g(kGuardBytes);
    if (cudaMemcpy(g.data(), static_cast<char*>(ptr_) + bytes_, kGuardBytes,
                   cudaMemcpyDeviceToHost) != cudaSuccess) {
      return false;
    }
    for (uint8_t x : g) {
      if (x != kGuardByte) return false;
    }
    return true;
  }
  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Free() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A bundle's inputs on the device and its poisoned outputs (o: bf16 0xFFFF = NaN, lse: NaN),
// each followed by guard bytes.
struct DeviceBundle {
  DeviceBuffer q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, o, lse;
  kernels::VerifyProblem problem;

  cudaError_t Upload(const BundleView& v) {
    auto up = [](DeviceBuffer& d, const auto* src, size_t n) {
      cudaError_t e = d.Reset(std::max<size_t>(n, 1) * sizeof(*src));
      if (e == cudaSuccess && n > 0) {
        e = cudaMemcpy(d.get<void>(), src, n * sizeof(*src), cudaMemcpyHostToDevice);
      }
      return e;
    };
    cudaError_t e;
    if ((e = up(q, v.q, v.q_elems())) != cudaSuccess) return e;
    if ((e = up(kv_pool, v.kv_pool, v.kv_elems())) != cudaSuccess) return e;
    if ((e = up(kv_indptr, v.kv_indptr, v.shape.batch + 1)) != cudaSuccess) return e;
    if ((e = up(kv_indices, v.kv_indices, v.shape.num_indices)) != cudaSuccess) return e;
    if ((e = up(kv_lens, v.kv_lens, v.shape.batch)) != cudaSuccess) return e;
    if ((e = up(tree_mask, v.tree_mask, v.mask_bytes())) != cudaSuccess) return e;
    if ((e = o.Reset(v.o_elems() * 2)) != cudaSuccess) return e;
    if ((e = lse.Reset(v.lse_elems() * 4)) != cudaSuccess) return e;
    problem = {};
    problem.shape = v.shape;
    problem.q = q.get<uint16_t>();
    problem.kv_pool = kv_pool.get<uint16_t>();
    problem.kv_indptr = kv_indptr.get<int32_t>();
    problem.kv_indices = kv_indices.get<int32_t>();
    problem.kv_lens = kv_lens.get<int32_t>();
    problem.tree_mask = tree_mask.get<uint8_t>();
    problem.sm_scale = v.sm_scale;
    problem.max_kv_len = v.max_kv_len;
    problem.total_kv_len = v.total_kv_len;
    problem.o = o.get<uint16_t>();
    problem.lse = lse.get<float>();
    return Poison();
  }
  cudaError_t Poison() {
    cudaError_t e = o.Fill(0xFF);
    return e != cudaSuccess ? e : lse.Fill(0xFF);
  }
};

}  // namespace verifyd::testing
