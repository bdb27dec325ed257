#include "src/cuda_engine/cuda_prepared_bundle.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/reference/input_check_kernels.h"
#include "kernels/reference/page_gather_kernels.h"
#include "src/bundle/validate.h"

namespace verifyd {
namespace {

constexpr size_t kAlign = 256;
constexpr char kUploading[] = "copying the bundle to the device";

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

// Host bytes go through the lane's pinned staging in one copy; bytes the GPU reads itself (q and
// the pool or its pages, in pinned host memory or a CUDA IPC region) are copied after it.
enum { kQ, kPool, kIndptr, kIndices, kLens, kMask, kSrcPages, kCheck, kPieces };
struct Piece {
  const void* host = nullptr;  // staged from here; null: filled on the device (or absent)
  size_t bytes = 0;
  size_t offset = 0;
};

// Where each input of one upload comes from, and where it lies in the device allocation.
struct UploadPlan {
  bool q_in_place = false, pool_in_place = false;
  bool compact = false;  // a copied shared pool keeps only the pages the call names
  // Sources the GPU reads itself, else null.
  const void* q_src = nullptr;
  const void* pool_src = nullptr;
  bool gather_on_device = false, pool_direct = false, q_with_gather = false;
  // kv_indices and tree_mask are in the GPU's memory (BundleView::indices_device): copied by the
  // checked copy into the piece `checked_indices` names and kMask, its outcome in kCheck.
  bool checked_on_device = false;
  int checked_indices = kIndices;
  size_t page_bytes = 0, n_idx = 0, q_bytes = 0;
  std::vector<int32_t> renumbered;  // a compacted pool's kv_indices
  Piece pieces[kPieces];
  size_t staged = 0, total = 0;  // bytes of the staged pieces, and of all of them
};

void PlanUpload(const BundleView& v, bool detach, UploadPlan* plan) {
  const auto& s = v.shape;
  UploadPlan& u = *plan;
  u.page_bytes = size_t(s.page_size) * kernels::kHeadDimQK * 2;
  u.n_idx = size_t(s.num_indices);
  // In place: q and the pool are read where the client keeps them (a CUDA IPC region), for a
  // call that is over before the client may change them. Work after the response (detach) reads
  // a snapshot instead. A shared pool that is copied is compacted to the pages the call names.
  u.q_in_place = v.q_device >= 0 && !detach;
  u.pool_in_place = v.kv_pool_device >= 0 && !detach;
  u.compact = v.kv_pool_shared && !u.pool_in_place;
  // Sources the GPU reads itself: a CUDA IPC region, or host memory the engine pinned
  // (CudaEngine::PinHostMemory: a shm region, a call channel's area). Their bytes skip the
  // staging copy.
  u.q_src = v.q_device >= 0 ? v.q : DeviceReadable(v.q);
  u.pool_src = v.kv_pool_device >= 0 ? v.kv_pool : DeviceReadable(v.kv_pool);
  u.gather_on_device = u.compact && u.pool_src != nullptr;
  u.pool_direct = !u.compact && u.pool_src != nullptr;
  // A snapshot's q rides along with the gather of its pages when the GPU reads it with 16-byte
  // loads: one launch instead of two.
  u.q_with_gather =
      u.gather_on_device && u.q_src != nullptr && !u.q_in_place && kernels::CopyAligned(u.q_src);
  // The pool is then on the device too (PrepareOn), read in place or gathered there, so the
  // checked copy of its page ids is what the kernels or the gather read.
  u.checked_on_device = v.indices_device >= 0;
  u.checked_indices = u.compact ? kSrcPages : kIndices;
  if (u.compact) {
    u.renumbered.resize(u.n_idx);
    for (size_t i = 0; i < u.n_idx; ++i) u.renumbered[i] = static_cast<int32_t>(i);
  }

  auto& pieces = u.pieces;
  u.q_bytes = size_t(v.q_elems()) * 2;
  if (!u.q_in_place) pieces[kQ] = {u.q_src != nullptr ? nullptr : v.q, u.q_bytes};
  if (!u.pool_in_place) {
    pieces[kPool] = u.compact
                        ? Piece{u.gather_on_device ? nullptr : v.kv_pool, u.n_idx * u.page_bytes}
                        : Piece{u.pool_direct ? nullptr : v.kv_pool, size_t(v.kv_elems()) * 2};
  }
  pieces[kIndptr] = {v.kv_indptr, size_t(s.batch + 1) * 4};
  pieces[kIndices] = {u.compact ? u.renumbered.data() : v.kv_indices, u.n_idx * 4};
  pieces[kLens] = {v.kv_lens, size_t(s.batch) * 4};
  pieces[kMask] = {v.tree_mask, size_t(v.mask_bytes())};
  if (u.gather_on_device) pieces[kSrcPages] = {v.kv_indices, u.n_idx * 4};
  if (u.checked_on_device) {
    pieces[u.checked_indices].host = nullptr;
    pieces[kMask].host = nullptr;
    static const kernels::InputCheckStatus kNothingBad{kernels::kNoBadEntry, kernels::kNoBadEntry};
    pieces[kCheck] = {&kNothingBad, sizeof(kNothingBad)};
  }
  // Staged pieces first, so that one copy moves them all.
  for (int pass = 0; pass < 2; ++pass) {
    for (Piece& p : pieces) {
      const bool host = p.host != nullptr;
      if (p.bytes == 0 || host != (pass == 0)) continue;
      p.offset = u.total;
      u.total += AlignUp(p.bytes);
    }
    if (pass == 0) u.staged = u.total;
  }
}

// The kernels' input pointers: into the device allocation `dev`, or where the client keeps them.
void PointProblemAt(const UploadPlan& u, const BundleView& v, char* dev,
                    kernels::VerifyProblem* problem) {
  const auto& pieces = u.pieces;
  problem->q = u.q_in_place ? v.q : reinterpret_cast<const uint16_t*>(dev + pieces[kQ].offset);
  problem->kv_pool =
      u.pool_in_place ? v.kv_pool : reinterpret_cast<const uint16_t*>(dev + pieces[kPool].offset);
  problem->kv_indptr = reinterpret_cast<const int32_t*>(dev + pieces[kIndptr].offset);
  problem->kv_indices = reinterpret_cast<const int32_t*>(dev + pieces[kIndices].offset);
  problem->kv_lens = reinterpret_cast<const int32_t*>(dev + pieces[kLens].offset);
  problem->tree_mask = reinterpret_cast<const uint8_t*>(dev + pieces[kMask].offset);
  if (u.compact) problem->shape.num_pages = v.shape.num_indices;
}

// The host pieces into the staging buffer.
void FillStaging(const UploadPlan& u, const BundleView& v, char* staging) {
  for (int i = 0; i < kPieces; ++i) {
    const Piece& p = u.pieces[i];
    if (p.host == nullptr || p.bytes == 0) continue;
    char* to = staging + p.offset;
    if (i == kPool && u.compact) {  // the named pages of a host pool, in kv_indices order
      for (size_t k = 0; k < u.n_idx; ++k) {
        std::memcpy(
            to + k * u.page_bytes,
            reinterpret_cast<const char*>(v.kv_pool) + size_t(v.kv_indices[k]) * u.page_bytes,
            u.page_bytes);
      }
    } else {
      std::memcpy(to, p.host, p.bytes);
    }
  }
}

// On the served stream: the staged pieces in one copy (`copied` recorded after it), the checked
// copy of page ids and mask in device memory (its outcome copied to `check_host` when given),
// then q and the pool or its pages from where the GPU reads them itself (`inputs_ready` recorded
// after all).
absl::Status CopyToDevice(const UploadPlan& u, const BundleView& v, DeviceWorker& worker,
                          Lane& lane, const char* staging, cudaEvent_t copied, char* dev,
                          cudaEvent_t inputs_ready, kernels::InputCheckStatus* check_host) {
  const auto& pieces = u.pieces;
  absl::Status st;
  if (u.staged > 0) {
    st = worker.Check(cudaMemcpyAsync(dev, staging, u.staged, cudaMemcpyHostToDevice, lane.served),
                      kUploading);
  }
  if (st.ok()) st = worker.Check(cudaEventRecord(copied, lane.served), kUploading);
  if (st.ok() && u.checked_on_device) {
    auto* status = reinterpret_cast<kernels::InputCheckStatus*>(dev + pieces[kCheck].offset);
    st = worker.Check(
        kernels::LaunchCheckedInputCopy(
            v.kv_indices, v.shape.num_indices, v.shape.num_pages,
            reinterpret_cast<int32_t*>(dev + pieces[u.checked_indices].offset), v.tree_mask,
            v.mask_bytes(), v.shape.mask_format, v.shape.draft,
            reinterpret_cast<uint8_t*>(dev + pieces[kMask].offset), status, lane.served),
        "checking kv_indices and tree_mask on the device");
    if (st.ok() && check_host != nullptr) {
      st = worker.Check(
          cudaMemcpyAsync(check_host, status, sizeof(*status), cudaMemcpyDeviceToHost, lane.served),
          "checking kv_indices and tree_mask on the device");
    }
  }
  if (st.ok() && u.q_src != nullptr && !u.q_in_place && !u.q_with_gather) {
    st = worker.Check(cudaMemcpyAsync(dev + pieces[kQ].offset, u.q_src, u.q_bytes,
                                      cudaMemcpyDefault, lane.served),
                      "copying q");
  }
  if (st.ok() && u.pool_direct && !u.pool_in_place) {
    st = worker.Check(cudaMemcpyAsync(dev + pieces[kPool].offset, u.pool_src, pieces[kPool].bytes,
                                      cudaMemcpyDefault, lane.served),
                      "copying kv_pool");
  }
  if (st.ok() && u.gather_on_device) {
    kernels::CopyRange q_range;
    if (u.q_with_gather) {
      q_range = {u.q_src, dev + pieces[kQ].offset, static_cast<int64_t>(u.q_bytes)};
    }
    st = worker.Check(
        kernels::LaunchGatherPages(u.pool_src,
                                   reinterpret_cast<const int32_t*>(dev + pieces[kSrcPages].offset),
                                   v.shape.num_indices, static_cast<int64_t>(u.page_bytes),
                                   dev + pieces[kPool].offset, lane.served, q_range),
        "snapshotting the KV pages");
  }
  if (st.ok()) st = worker.Check(cudaEventRecord(inputs_ready, lane.served), kUploading);
  return st;
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
  UploadPlan plan;
  PlanUpload(v, detach, &plan);
  q_in_place_ = plan.q_in_place;
  pool_in_place_ = plan.pool_in_place;

  if (absl::Status st = worker_.Check(
          cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), kUploading);
      !st.ok()) {
    return st;
  }
  if (absl::Status st =
          worker_.Check(cudaMallocFromPoolAsync(&inputs_, std::max<size_t>(plan.total, kAlign),
                                                worker_.pool(), lane_.served),
                        kUploading);
      !st.ok()) {
    inputs_ = nullptr;
    return st;
  }
  char* dev = static_cast<char*>(inputs_);
  PointProblemAt(plan, v, dev, &problem_);
  kernels::InputCheckStatus* check_host = nullptr;
  if (plan.checked_on_device) {
    absl::MutexLock lock(&mu_);
    checks_on_device_ = true;
    check_device_ = reinterpret_cast<kernels::InputCheckStatus*>(dev + plan.pieces[kCheck].offset);
    check_host = check_host_ = worker_.check_slots().Acquire();
  }

  Staging& in = lane_.input;
  absl::MutexLock lock(&in.mu);
  // The previous upload through this buffer must have left it before it is overwritten.
  if (absl::Status st = worker_.Check(cudaEventSynchronize(in.copied), kUploading); !st.ok()) {
    return st;
  }
  if (absl::Status st =
          worker_.Check(in.buffer.Reserve(std::max<size_t>(plan.staged, 1)), kUploading);
      !st.ok()) {
    return st;
  }
  FillStaging(plan, v, in.buffer.data());
  return CopyToDevice(plan, v, worker_, lane_, in.buffer.data(), in.copied, dev, inputs_ready_,
                      check_host);
}

absl::Status CudaPreparedBundle::InputChecks() {
  absl::MutexLock lock(&mu_);
  if (!checks_on_device_) return absl::OkStatus();
  if (checks_) return *checks_;
  const char* where = "reading the outcome of the checks on the device";
  // The outcome was copied before inputs_ready, which the paths' kernels waited for.
  kernels::InputCheckStatus status{};
  absl::Status st = worker_.AwaitCritical(inputs_ready_, where);
  if (st.ok() && check_host_ != nullptr) {
    status = *check_host_;
  } else if (st.ok()) {
    st = worker_.Check(cudaMemcpy(&status, check_device_, sizeof(status), cudaMemcpyDeviceToHost),
                       where);
  }
  worker_.check_slots().Release(check_host_);
  check_host_ = nullptr;
  if (!st.ok()) return st;  // not kept: a device error is the device's, not the call's
  const kernels::ProblemShape& s = shape();
  if (status.bad_index != kernels::kNoBadEntry) {
    checks_ = BadPageId(static_cast<int64_t>(status.bad_index >> 32),
                        static_cast<int32_t>(status.bad_index & 0xffffffffu), s.num_pages);
  } else if (status.bad_mask != kernels::kNoBadEntry) {
    checks_ = BadMaskByte(s, static_cast<int64_t>(status.bad_mask >> 32),
                          static_cast<uint8_t>(status.bad_mask & 0xffu));
  } else {
    checks_ = absl::OkStatus();
  }
  return *checks_;
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
  if (check_host_ != nullptr) {  // its copy, before inputs_ready, may still be in flight
    cudaEventSynchronize(inputs_ready_);
    worker_.check_slots().Release(check_host_);
  }
  if (inputs_ready_ != nullptr) cudaEventDestroy(inputs_ready_);
  if (shadow_last_ != nullptr) cudaEventDestroy(shadow_last_);
  cudaGetLastError();  // nothing to report from a destructor
}

}  // namespace verifyd
