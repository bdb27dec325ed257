#pragma once
// Device buffers with guard bytes, and a bundle uploaded as a kernels::VerifyProblem with poisoned
// outputs: for the GPU suites (gpu_test_support.h) and the kernel trace tool (bench/), which
// builds without GoogleTest.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/verify_problem.h"
#include "src/bundle/bundle.h"

namespace verifyd::testing {

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
    // The pool at its own element size: bf16, or an e4m3 pool's one-byte codes.
    if ((e = up(kv_pool, static_cast<const uint8_t*>(v.kv_pool), v.kv_bytes())) != cudaSuccess) {
      return e;
    }
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
    problem.kv_scale = v.kv_scale;
    problem.o_scale = v.o_scale;
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
