#include "src/engine/cuda/cuda_prepared_bundle.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/reference/page_gather_kernels.h"

namespace verifyd {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int Index(Path p) { return static_cast<int>(p); }

// The device address of host memory registered with CUDA (cudaHostRegister), or null for memory
// the GPU cannot read itself.
const void* DeviceReadable(const void* host) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, host) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return a.type == cudaMemoryTypeHost ? a.devicePointer : nullptr;
}

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

absl::Status CudaPreparedBundle::Upload(const BundleView& v, bool detach) {
  const auto& s = v.shape;
  const size_t page_bytes = size_t(s.page_size) * kernels::kHeadDimQK * 2;
  const size_t n_idx = size_t(s.num_indices);
  // In place: q and the pool are read where the client keeps them (a CUDA IPC region), for a
  // call that is over before the client may change them. Work after the response (detach) reads
  // a snapshot instead. A shared pool that is copied is compacted to the pages the call names.
  q_in_place_ = v.q_device >= 0 && !detach;
  pool_in_place_ = v.kv_pool_device >= 0 && !detach;
  const bool compact = v.kv_pool_shared && !pool_in_place_;
  // Sources the GPU reads itself: a CUDA IPC region, or host memory the engine pinned
  // (CudaEngine::PinHostMemory: a shm region, a call channel's area). Their bytes skip the
  // staging copy.
  const void* q_src = v.q_device >= 0 ? v.q : DeviceReadable(v.q);
  const void* pool_src = v.kv_pool_device >= 0 ? v.kv_pool : DeviceReadable(v.kv_pool);
  const bool gather_on_device = compact && pool_src != nullptr;
  const bool pool_direct = !compact && pool_src != nullptr;
  // A snapshot's q rides along with the gather of its pages when the GPU reads it with 16-byte
  // loads: one launch instead of two.
  const bool q_with_gather = gather_on_device && q_src != nullptr && !q_in_place_ &&
                             kernels::CopyAligned(q_src);
  std::vector<int32_t> renumbered;
  if (compact) {
    renumbered.resize(n_idx);
    for (size_t i = 0; i < n_idx; ++i) renumbered[i] = static_cast<int32_t>(i);
  }

  // Host bytes go through the lane's pinned staging in one copy; bytes the GPU reads itself (q and
  // the pool or its pages, in pinned host memory or a CUDA IPC region) are copied after it.
  enum { kQ, kPool, kIndptr, kIndices, kLens, kMask, kSrcPages, kPieces };
  struct Piece {
    const void* host = nullptr;  // staged from here; null: filled on the device (or absent)
    size_t bytes = 0;
    size_t offset = 0;
  };
  Piece pieces[kPieces];
  const size_t q_bytes = size_t(v.q_elems()) * 2;
  if (!q_in_place_) pieces[kQ] = {q_src != nullptr ? nullptr : v.q, q_bytes};
  if (!pool_in_place_) {
    pieces[kPool] = compact ? Piece{gather_on_device ? nullptr : v.kv_pool, n_idx * page_bytes}
                            : Piece{pool_direct ? nullptr : v.kv_pool, size_t(v.kv_elems()) * 2};
  }
  pieces[kIndptr] = {v.kv_indptr, size_t(s.batch + 1) * 4};
  pieces[kIndices] = {compact ? renumbered.data() : v.kv_indices, n_idx * 4};
  pieces[kLens] = {v.kv_lens, size_t(s.batch) * 4};
  pieces[kMask] = {v.tree_mask, size_t(v.mask_bytes())};
  if (gather_on_device) pieces[kSrcPages] = {v.kv_indices, n_idx * 4};
  // Staged pieces first, so that one copy moves them all.
  size_t staged = 0, total = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (Piece& p : pieces) {
      const bool host = p.host != nullptr;
      if (p.bytes == 0 || host != (pass == 0)) continue;
      p.offset = total;
      total += AlignUp(p.bytes);
    }
    if (pass == 0) staged = total;
  }

  const std::string where = "copying the bundle to the device";
  if (absl::Status st =
          worker_.Check(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), where);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = worker_.Check(
          cudaMallocFromPoolAsync(&inputs_, std::max<size_t>(total, kAlign), worker_.pool(),
                                  lane_.served),
          where);
      !st.ok()) {
    inputs_ = nullptr;
    return st;
  }
  char* dev = static_cast<char*>(inputs_);
  problem_.q = q_in_place_ ? v.q : reinterpret_cast<const uint16_t*>(dev + pieces[kQ].offset);
  problem_.kv_pool = pool_in_place_
                         ? v.kv_pool
                         : reinterpret_cast<const uint16_t*>(dev + pieces[kPool].offset);
  problem_.kv_indptr = reinterpret_cast<const int32_t*>(dev + pieces[kIndptr].offset);
  problem_.kv_indices = reinterpret_cast<const int32_t*>(dev + pieces[kIndices].offset);
  problem_.kv_lens = reinterpret_cast<const int32_t*>(dev + pieces[kLens].offset);
  problem_.tree_mask = reinterpret_cast<const uint8_t*>(dev + pieces[kMask].offset);
  if (compact) problem_.shape.num_pages = s.num_indices;

  Staging& in = lane_.input;
  absl::MutexLock lock(&in.mu);
  // The previous upload through this buffer must have left it before it is overwritten.
  if (absl::Status st = worker_.Check(cudaEventSynchronize(in.copied), where); !st.ok()) return st;
  if (absl::Status st = worker_.Check(in.buffer.Reserve(std::max<size_t>(staged, 1)), where);
      !st.ok()) {
    return st;
  }
  for (int i = 0; i < kPieces; ++i) {
    const Piece& p = pieces[i];
    if (p.host == nullptr || p.bytes == 0) continue;
    char* to = in.buffer.data() + p.offset;
    if (i == kPool && compact) {  // the named pages of a host pool, in kv_indices order
      for (size_t k = 0; k < n_idx; ++k) {
        std::memcpy(to + k * page_bytes,
                    reinterpret_cast<const char*>(v.kv_pool) + size_t(v.kv_indices[k]) * page_bytes,
                    page_bytes);
      }
    } else {
      std::memcpy(to, p.host, p.bytes);
    }
  }
  absl::Status st;
  if (staged > 0) {
    st = worker_.Check(
        cudaMemcpyAsync(inputs_, in.buffer.data(), staged, cudaMemcpyHostToDevice, lane_.served),
        where);
  }
  if (st.ok()) st = worker_.Check(cudaEventRecord(in.copied, lane_.served), where);
  if (st.ok() && q_src != nullptr && !q_in_place_ && !q_with_gather) {
    st = worker_.Check(cudaMemcpyAsync(dev + pieces[kQ].offset, q_src, q_bytes, cudaMemcpyDefault,
                                       lane_.served),
                       "copying q");
  }
  if (st.ok() && pool_direct && !pool_in_place_) {
    st = worker_.Check(cudaMemcpyAsync(dev + pieces[kPool].offset, pool_src,
                                       pieces[kPool].bytes, cudaMemcpyDefault, lane_.served),
                       "copying kv_pool");
  }
  if (st.ok() && gather_on_device) {
    kernels::CopyRange q_range;
    if (q_with_gather) q_range = {q_src, dev + pieces[kQ].offset, static_cast<int64_t>(q_bytes)};
    st = worker_.Check(kernels::LaunchGatherPages(
                           pool_src, reinterpret_cast<const int32_t*>(dev + pieces[kSrcPages].offset),
                           s.num_indices, static_cast<int64_t>(page_bytes),
                           dev + pieces[kPool].offset, lane_.served, q_range),
                       "snapshotting the KV pages");
  }
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
