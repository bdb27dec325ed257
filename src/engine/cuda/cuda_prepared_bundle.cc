#include "src/engine/cuda/cuda_prepared_bundle.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int Index(Path p) { return static_cast<int>(p); }

}  // namespace

CudaPreparedBundle::CudaPreparedBundle(DeviceWorker& worker, Lane& lane, const BundleView& v)
    : PreparedBundle(v.shape),
      worker_(worker),
      lane_(lane),
      o_elems_(v.o_elems()),
      lse_elems_(v.lse_elems()) {
  problem_.shape = v.shape;
  problem_.sm_scale = v.sm_scale;
  problem_.max_kv_len = v.max_kv_len;
  problem_.total_kv_len = v.total_kv_len;
}

absl::Status CudaPreparedBundle::Upload(const BundleView& v) {
  struct Piece {
    const void* src;
    size_t bytes;
    size_t offset;
  };
  const auto& s = v.shape;
  Piece pieces[] = {
      {v.q, size_t(v.q_elems()) * 2, 0},         {v.kv_pool, size_t(v.kv_elems()) * 2, 0},
      {v.kv_indptr, size_t(s.batch + 1) * 4, 0}, {v.kv_indices, size_t(s.num_indices) * 4, 0},
      {v.kv_lens, size_t(s.batch) * 4, 0},       {v.tree_mask, size_t(v.mask_bytes()), 0},
  };
  size_t total = 0;
  for (Piece& p : pieces) {
    p.offset = total;
    total += AlignUp(std::max<size_t>(p.bytes, 1));
  }

  const std::string where = "copying the bundle to the device";
  if (absl::Status st =
          worker_.Check(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), where);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = worker_.Check(
          cudaMallocFromPoolAsync(&inputs_, total, worker_.pool(), lane_.served), where);
      !st.ok()) {
    inputs_ = nullptr;
    return st;
  }
  char* dev = static_cast<char*>(inputs_);
  problem_.q = reinterpret_cast<const uint16_t*>(dev + pieces[0].offset);
  problem_.kv_pool = reinterpret_cast<const uint16_t*>(dev + pieces[1].offset);
  problem_.kv_indptr = reinterpret_cast<const int32_t*>(dev + pieces[2].offset);
  problem_.kv_indices = reinterpret_cast<const int32_t*>(dev + pieces[3].offset);
  problem_.kv_lens = reinterpret_cast<const int32_t*>(dev + pieces[4].offset);
  problem_.tree_mask = reinterpret_cast<const uint8_t*>(dev + pieces[5].offset);

  Staging& in = lane_.input;
  absl::MutexLock lock(&in.mu);
  // The previous upload through this buffer must have left it before it is overwritten.
  if (absl::Status st = worker_.Check(cudaEventSynchronize(in.copied), where); !st.ok()) return st;
  if (absl::Status st = worker_.Check(in.buffer.Reserve(total), where); !st.ok()) return st;
  for (const Piece& p : pieces) {
    if (p.bytes > 0) std::memcpy(in.buffer.data() + p.offset, p.src, p.bytes);
  }
  absl::Status st = worker_.Check(
      cudaMemcpyAsync(inputs_, in.buffer.data(), total, cudaMemcpyHostToDevice, lane_.served),
      where);
  if (st.ok()) st = worker_.Check(cudaEventRecord(in.copied, lane_.served), where);
  if (st.ok()) st = worker_.Check(cudaEventRecord(inputs_ready_, lane_.served), where);
  return st;
}

absl::StatusOr<DevicePathOutput> CudaPreparedBundle::Outputs(Path p, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  DevicePathOutput& out = paths_[Index(p)];
  if (out.o != nullptr) return out;
  const std::string where = absl::StrCat("allocating the ", PathName(p), " output");
  const size_t o_bytes = size_t(o_elems_) * (p == Path::kOracle ? 4 : 2);
  const size_t lse_bytes = size_t(lse_elems_) * 4;
  // Each piece is kept as soon as it exists, so that a retry after a failure leaks nothing.
  absl::Status st;
  if (out.start == nullptr) st = worker_.Check(cudaEventCreate(&out.start), where);
  if (!st.ok()) out.start = nullptr;
  if (st.ok() && out.done == nullptr) {
    st = worker_.Check(cudaEventCreate(&out.done), where);
    if (!st.ok()) out.done = nullptr;
  }
  if (st.ok() && out.lse == nullptr) {
    void* lse = nullptr;
    st = worker_.Check(cudaMallocFromPoolAsync(&lse, lse_bytes, worker_.pool(), stream), where);
    if (st.ok()) out.lse = static_cast<float*>(lse);
  }
  if (st.ok()) {
    void* o = nullptr;
    st = worker_.Check(cudaMallocFromPoolAsync(&o, o_bytes, worker_.pool(), stream), where);
    if (st.ok()) out.o = o;
  }
  if (!st.ok()) return st;
  return out;
}

void CudaPreparedBundle::MarkRan(Path p) {
  absl::MutexLock lock(&mu_);
  paths_[Index(p)].ran = true;
}

DevicePathOutput CudaPreparedBundle::State(Path p) const {
  absl::MutexLock lock(&mu_);
  return paths_[Index(p)];
}

absl::Status CudaPreparedBundle::RecordShadowUse() {
  absl::MutexLock lock(&mu_);
  const char* where = "recording the shadow stream's use of a bundle";
  if (shadow_last_ == nullptr) {
    if (absl::Status st =
            worker_.Check(cudaEventCreateWithFlags(&shadow_last_, cudaEventDisableTiming), where);
        !st.ok()) {
      shadow_last_ = nullptr;
      return st;
    }
  }
  return worker_.Check(cudaEventRecord(shadow_last_, lane_.shadow), where);
}

CudaPreparedBundle::~CudaPreparedBundle() {
  if (!worker_.Activate().ok()) return;  // the context is lost: nothing left to free
  absl::MutexLock lock(&mu_);
  // Freed in order on the served stream, after whatever the shadow stream still does with it.
  if (shadow_last_ != nullptr) cudaStreamWaitEvent(lane_.served, shadow_last_, 0);
  for (DevicePathOutput& p : paths_) {
    if (p.o != nullptr) cudaFreeAsync(p.o, lane_.served);
    if (p.lse != nullptr) cudaFreeAsync(p.lse, lane_.served);
    if (p.start != nullptr) cudaEventDestroy(p.start);
    if (p.done != nullptr) cudaEventDestroy(p.done);
  }
  if (inputs_ != nullptr) cudaFreeAsync(inputs_, lane_.served);
  if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
  if (shadow_last_ != nullptr) cudaEventDestroy(shadow_last_);
  cudaGetLastError();  // nothing to report from a destructor
}

}  // namespace verifyd
