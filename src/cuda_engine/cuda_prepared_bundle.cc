#include "src/cuda_engine/cuda_prepared_bundle.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/reference/input_check_kernels.h"
#include "kernels/reference/kv_dequantize_kernels.h"
#include "kernels/reference/page_gather_kernels.h"
#include "src/common/status_macros.h"

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
  char* at = nullptr;  // its device address
};

// Which pieces one allocation holds: all of them; or, when the page ids are checked on the device,
// the layout's (kv_indptr, kv_lens, the checked page ids, the mask and the checks' outcome: a
// DeviceLayout) apart from the rest (q and the pool when they are copied, a compacted pool's
// renumbered page ids).
enum class Group { kWhole, kLayout, kRest };

// Where each input of one upload comes from, and where it lies in the device allocation.
struct UploadPlan {
  Group group = Group::kWhole;
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

bool InLayout(const UploadPlan& u, int piece) {
  return piece == kIndptr || piece == kLens || piece == u.checked_indices || piece == kMask ||
         piece == kCheck;
}

void PlanUpload(const BundleView& v, bool detach, Group group, UploadPlan* plan) {
  const auto& s = v.shape;
  UploadPlan& u = *plan;
  u.group = group;
  u.page_bytes = size_t(v.page_bytes());
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
  if (u.compact && group != Group::kLayout) {
    u.renumbered.resize(u.n_idx);
    for (size_t i = 0; i < u.n_idx; ++i) u.renumbered[i] = static_cast<int32_t>(i);
  }

  auto& pieces = u.pieces;
  u.q_bytes = size_t(v.q_elems()) * 2;
  if (!u.q_in_place) pieces[kQ] = {u.q_src != nullptr ? nullptr : v.q, u.q_bytes};
  if (!u.pool_in_place) {
    pieces[kPool] = u.compact
                        ? Piece{u.gather_on_device ? nullptr : v.kv_pool, u.n_idx * u.page_bytes}
                        : Piece{u.pool_direct ? nullptr : v.kv_pool, size_t(v.kv_bytes())};
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
  // The other group's pieces are another allocation's.
  if (group != Group::kWhole) {
    for (int i = 0; i < kPieces; ++i) {
      if (InLayout(u, i) != (group == Group::kLayout)) pieces[i] = Piece{};
    }
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

// The device addresses of the plan's own pieces in allocation `dev`.
void PlaceAt(char* dev, UploadPlan* u) {
  for (Piece& p : u->pieces) {
    if (p.bytes > 0) p.at = dev + p.offset;
  }
}

// The kernels' input pointers: into the device allocations, or where the client keeps them.
void PointProblemAt(const UploadPlan& u, const BundleView& v, kernels::VerifyProblem* problem) {
  const auto& pieces = u.pieces;
  problem->q = u.q_in_place ? v.q : reinterpret_cast<const uint16_t*>(pieces[kQ].at);
  problem->kv_pool = u.pool_in_place ? static_cast<const uint16_t*>(v.kv_pool)
                                     : reinterpret_cast<const uint16_t*>(pieces[kPool].at);
  problem->kv_indptr = reinterpret_cast<const int32_t*>(pieces[kIndptr].at);
  problem->kv_indices = reinterpret_cast<const int32_t*>(pieces[kIndices].at);
  problem->kv_lens = reinterpret_cast<const int32_t*>(pieces[kLens].at);
  problem->tree_mask = reinterpret_cast<const uint8_t*>(pieces[kMask].at);
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

// On the served stream: the staged pieces in one copy to `dev` (`copied` recorded after it), the
// checked copy of page ids and mask in device memory (its outcome copied to `check_host` when
// given), then q and the pool or its pages from where the GPU reads them itself (`done` recorded
// after all).
absl::Status CopyToDevice(const UploadPlan& u, const BundleView& v, DeviceWorker& worker,
                          Lane& lane, const char* staging, cudaEvent_t copied, char* dev,
                          cudaEvent_t done, kernels::InputCheckStatus* check_host) {
  const auto& pieces = u.pieces;
  absl::Status st;
  if (u.staged > 0) {
    st = worker.Check(cudaMemcpyAsync(dev, staging, u.staged, cudaMemcpyHostToDevice, lane.served),
                      kUploading);
    if (st.ok()) st = worker.Check(cudaEventRecord(copied, lane.served), kUploading);
  }
  if (st.ok() && u.checked_on_device && u.group != Group::kRest) {
    auto* status = reinterpret_cast<kernels::InputCheckStatus*>(pieces[kCheck].at);
    st = worker.Check(kernels::LaunchCheckedInputCopy(
                          v.kv_indices, v.shape.num_indices, v.shape.num_pages,
                          reinterpret_cast<int32_t*>(pieces[u.checked_indices].at), v.tree_mask,
                          v.mask_bytes(), v.shape.mask_format, v.shape.draft,
                          reinterpret_cast<uint8_t*>(pieces[kMask].at), status, lane.served),
                      "checking kv_indices and tree_mask on the device");
    if (st.ok() && check_host != nullptr) {
      st = worker.Check(
          cudaMemcpyAsync(check_host, status, sizeof(*status), cudaMemcpyDeviceToHost, lane.served),
          "checking kv_indices and tree_mask on the device");
    }
  }
  if (u.group == Group::kLayout) {
    return st.ok() ? worker.Check(cudaEventRecord(done, lane.served), kUploading) : st;
  }
  if (st.ok() && u.q_src != nullptr && !u.q_in_place && !u.q_with_gather) {
    st = worker.Check(
        cudaMemcpyAsync(pieces[kQ].at, u.q_src, u.q_bytes, cudaMemcpyDefault, lane.served),
        "copying q");
  }
  if (st.ok() && u.pool_direct && !u.pool_in_place) {
    st = worker.Check(cudaMemcpyAsync(pieces[kPool].at, u.pool_src, pieces[kPool].bytes,
                                      cudaMemcpyDefault, lane.served),
                      "copying kv_pool");
  }
  if (st.ok() && u.gather_on_device) {
    kernels::CopyRange q_range;
    if (u.q_with_gather) q_range = {u.q_src, pieces[kQ].at, static_cast<int64_t>(u.q_bytes)};
    st = worker.Check(
        kernels::LaunchGatherPages(
            u.pool_src, reinterpret_cast<const int32_t*>(pieces[kSrcPages].at), v.shape.num_indices,
            static_cast<int64_t>(u.page_bytes), pieces[kPool].at, lane.served, q_range),
        "snapshotting the KV pages");
  }
  if (st.ok()) st = worker.Check(cudaEventRecord(done, lane.served), kUploading);
  return st;
}

// Allocates the plan's pieces from the worker's pool (none when it has none), places them, and
// queues their copies on the lane's served stream through its pinned staging (`done` recorded
// after them).
absl::Status Send(const BundleView& v, DeviceWorker& worker, Lane& lane, UploadPlan* u,
                  void** allocation, cudaEvent_t done, kernels::InputCheckStatus* check_host) {
  if (u->total > 0) {
    if (absl::Status st = worker.Check(
            cudaMallocFromPoolAsync(allocation, u->total, worker.pool(), lane.served), kUploading);
        !st.ok()) {
      *allocation = nullptr;
      return st;
    }
  }
  char* dev = static_cast<char*>(*allocation);
  PlaceAt(dev, u);
  Staging& in = lane.input;
  absl::MutexLock lock(&in.mu);
  if (u->staged > 0) {
    // The previous upload through this buffer must have left it before it is overwritten.
    if (absl::Status st = worker.Check(cudaEventSynchronize(in.copied), kUploading); !st.ok()) {
      return st;
    }
    if (absl::Status st = worker.Check(in.buffer.Reserve(u->staged), kUploading); !st.ok()) {
      return st;
    }
    FillStaging(*u, v, in.buffer.data());
  }
  return CopyToDevice(*u, v, worker, lane, in.buffer.data(), in.copied, dev, done, check_host);
}

absl::Status TakeEvent(DeviceWorker& worker, Lane& lane, cudaEvent_t* e) {
  return worker.Check(lane.events.Take(EventPool::Kind::kOrdering, e), kUploading);
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
  kv_scale_ = v.kv_scale;
  problem_.max_kv_len = v.max_kv_len;
  problem_.total_kv_len = v.total_kv_len;
}

absl::StatusOr<std::shared_ptr<DeviceLayout>> CudaPreparedBundle::UploadLayout(const BundleView& v,
                                                                               bool detach) {
  auto l = std::make_shared<DeviceLayout>(worker_, lane_, v);
  UploadPlan u;
  PlanUpload(v, detach, Group::kLayout, &u);
  VERIFYD_RETURN_IF_ERROR(TakeEvent(worker_, lane_, &l->ready));
  l->check_host = worker_.check_slots().Acquire();
  VERIFYD_RETURN_IF_ERROR(Send(v, worker_, lane_, &u, &l->allocation, l->ready, l->check_host));
  const Piece* p = u.pieces;
  l->indptr = reinterpret_cast<const int32_t*>(p[kIndptr].at);
  l->lens = reinterpret_cast<const int32_t*>(p[kLens].at);
  l->indices = reinterpret_cast<const int32_t*>(p[u.checked_indices].at);
  l->mask = reinterpret_cast<const uint8_t*>(p[kMask].at);
  l->check_device = reinterpret_cast<kernels::InputCheckStatus*>(p[kCheck].at);
  return l;
}

absl::Status CudaPreparedBundle::Upload(const BundleView& v, bool detach) {
  UploadPlan plan;
  if (v.indices_device < 0) {
    PlanUpload(v, detach, Group::kWhole, &plan);
  } else {
    // The layout: one this lane kept for the call's layout key, or uploaded and checked now.
    if (v.layout_key != 0) layout_ = lane_.layouts->Find(v);
    if (layout_ == nullptr) {
      VERIFYD_ASSIGN_OR_RETURN(layout_, UploadLayout(v, detach));
      if (v.layout_key != 0) lane_.layouts->Keep(layout_);
    }
    PlanUpload(v, detach, Group::kRest, &plan);
    Piece* p = plan.pieces;
    p[kIndptr].at = reinterpret_cast<char*>(const_cast<int32_t*>(layout_->indptr));
    p[kLens].at = reinterpret_cast<char*>(const_cast<int32_t*>(layout_->lens));
    p[plan.checked_indices].at = reinterpret_cast<char*>(const_cast<int32_t*>(layout_->indices));
    p[kMask].at = reinterpret_cast<char*>(const_cast<uint8_t*>(layout_->mask));
    p[kCheck].at = reinterpret_cast<char*>(layout_->check_device);
    // Nothing more to copy: the layout's copies, earlier on the same stream, are all it waits for.
    if (plan.total == 0) {
      inputs_ready_ = layout_->ready;
      inputs_done_ = layout_->Read();
    }
  }
  q_in_place_ = plan.q_in_place;
  pool_in_place_ = plan.pool_in_place;
  if (inputs_ready_ == nullptr) {
    VERIFYD_RETURN_IF_ERROR(TakeEvent(worker_, lane_, &inputs_ready_));
    owns_inputs_ready_ = true;
  }
  // A borrowed inputs_ready_ (the layout's) is not recorded again: nothing was left to copy.
  absl::Status st = owns_inputs_ready_
                        ? Send(v, worker_, lane_, &plan, &inputs_, inputs_ready_, nullptr)
                        : absl::OkStatus();
  PointProblemAt(plan, v, &problem_);
  // An e4m3 pool stays as sent; Bf16Problem dequantises it for the paths that read bf16.
  e4m3_ = v.shape.kv_dtype == kernels::KvDtype::kE4m3;
  if (e4m3_) problem_.kv_scale = kv_scale_;
  return st;
}

absl::StatusOr<kernels::VerifyProblem> CudaPreparedBundle::Bf16Problem(cudaStream_t s) {
  if (!e4m3_) return problem_;
  absl::MutexLock lock(&dq_mu_);
  if (!dequantized_status_) {
    dequantized_status_ = Dequantize(s);
  } else if (dequantized_status_->ok() && s != dequantized_on_) {
    dequantized_status_ = worker_.Check(cudaStreamWaitEvent(s, dequantized_ready_, 0),
                                        "waiting for the dequantised e4m3 KV pages");
  }
  if (!dequantized_status_->ok()) return *dequantized_status_;
  return bf16_;
}

absl::Status CudaPreparedBundle::Dequantize(cudaStream_t s) {
  const char* where = "dequantising the e4m3 KV pages";
  VERIFYD_RETURN_IF_ERROR(AwaitInputsOn(s, where));
  const int64_t n = problem_.shape.num_indices;
  const int64_t page_elems = int64_t{problem_.shape.page_size} * kernels::kHeadDimQK;
  const size_t pool_bytes = AlignUp(size_t(n * page_elems) * 2);
  VERIFYD_RETURN_IF_ERROR(worker_.Check(
      cudaMallocFromPoolAsync(&dequantized_, pool_bytes + size_t(n) * 4 + 4, worker_.pool(), s),
      where));
  dequantized_on_ = s;
  auto* pool = static_cast<uint16_t*>(dequantized_);
  auto* ids = reinterpret_cast<int32_t*>(static_cast<char*>(dequantized_) + pool_bytes);
  // After the upload; page ids past the pool read nothing (and the device's input checks refuse
  // the call).
  VERIFYD_RETURN_IF_ERROR(worker_.Check(
      kernels::LaunchDequantizeE4m3Pages(reinterpret_cast<const uint8_t*>(problem_.kv_pool),
                                         problem_.kv_indices, n, problem_.shape.num_pages,
                                         page_elems, pool, ids, s),
      where));
  bf16_ = problem_;
  bf16_.kv_pool = pool;
  bf16_.kv_indices = ids;
  bf16_.shape.num_pages = n;
  bf16_.shape.kv_dtype = kernels::KvDtype::kBf16;
  bf16_.sm_scale = problem_.sm_scale * kv_scale_;  // ValidateBundle: finite and > 0
  bf16_.kv_scale = 1.f;  // the pages hold the e4m3 values; the scale is on sm_scale and o
  bf16_.o_scale = kv_scale_;
  VERIFYD_RETURN_IF_ERROR(
      worker_.Check(lane_.events.Take(EventPool::Kind::kOrdering, &dequantized_ready_), where));
  return worker_.Check(cudaEventRecord(dequantized_ready_, s), where);
}

absl::StatusOr<kernels::VerifyProblem> CudaPreparedBundle::CustomProblem(
    const kernels::CustomConfig& config, cudaStream_t s) {
  kernels::CustomPlan plan;
  if (e4m3_ && kernels::ResolveCustomPlan(problem_, config, &plan) == cudaSuccess) {
    return problem_;
  }
  return Bf16Problem(s);
}

absl::Status CudaPreparedBundle::AwaitInputsOn(cudaStream_t s, absl::string_view where) {
  if (inputs_done_) return absl::OkStatus();
  return worker_.Check(cudaStreamWaitEvent(s, inputs_ready_, 0), where);
}

absl::Status CudaPreparedBundle::InputChecks() {
  return layout_ != nullptr ? layout_->Checks() : absl::OkStatus();
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
  constexpr EventPool::Kind kTiming = EventPool::Kind::kTiming;
  if (out.start == nullptr) st = worker_.Check(lane_.events.Take(kTiming, &out.start), where);
  if (st.ok() && out.done == nullptr) {
    st = worker_.Check(lane_.events.Take(kTiming, &out.done), where);
  }
  if (st.ok()) {  // o, then lse, in one allocation
    void* o = nullptr;
    st = worker_.Check(
        cudaMallocFromPoolAsync(&o, AlignUp(o_bytes) + lse_bytes, worker_.pool(), stream), where);
    if (st.ok()) {
      out.o = o;
      out.lse = reinterpret_cast<float*>(static_cast<char*>(o) + AlignUp(o_bytes));
    }
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
            worker_.Check(lane_.events.Take(EventPool::Kind::kOrdering, &shadow_last_), where);
        !st.ok()) {
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
    if (p.o != nullptr) cudaFreeAsync(p.o, lane_.served);  // lse lies in the same allocation
    lane_.events.Give(EventPool::Kind::kTiming, p.start);
    lane_.events.Give(EventPool::Kind::kTiming, p.done);
  }
  if (inputs_ != nullptr) cudaFreeAsync(inputs_, lane_.served);
  {
    absl::MutexLock dq_lock(&dq_mu_);
    // Made on the served stream (the reference) or the shadow stream (whose last use the served
    // stream waited for above).
    if (dequantized_ != nullptr) cudaFreeAsync(dequantized_, lane_.served);
    lane_.events.Give(EventPool::Kind::kOrdering, dequantized_ready_);
  }
  if (owns_inputs_ready_) lane_.events.Give(EventPool::Kind::kOrdering, inputs_ready_);
  lane_.events.Give(EventPool::Kind::kOrdering, shadow_last_);
  cudaGetLastError();  // nothing to report from a destructor
}

}  // namespace verifyd
