#include "src/loadgen/send_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "fmt/format.h"
#include "src/channel/shm_object.h"

#ifdef VERIFYD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace verifyd::cli {
namespace {

uint64_t Up(uint64_t x) { return (x + 255) / 256 * 256; }

absl::Status FromGrpc(const std::string& what, const grpc::Status& st) {
  return absl::Status(
      static_cast<absl::StatusCode>(st.error_code()),
      absl::StrCat(what, ": ", CodeName(st.error_code()), ": ", st.error_message()));
}

#ifdef VERIFYD_HAVE_CUDA
absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}
#endif

}  // namespace

bool ParseSendTransport(const std::string& name, SendTransport* out) {
  if (name == "inline")
    *out = SendTransport::kInline;
  else if (name == "shm")
    *out = SendTransport::kShm;
  else if (name == "cuda_ipc")
    *out = SendTransport::kCudaIpc;
  else
    return false;
  return true;
}

absl::StatusOr<std::unique_ptr<SendRegion>> SendRegion::Create(SendTransport t,
                                                               v1::VerifyService::Stub& stub,
                                                               const GlobalOptions& g, int slots,
                                                               const BundleView& v, int device,
                                                               bool want_lse) {
  std::unique_ptr<SendRegion> r(new SendRegion(t, stub, g));
  r->slots_ = slots;
  r->want_lse_ = want_lse;
  const auto& s = v.shape;
  Layout& l = r->layout_;
  uint64_t at = 0;
  auto take = [&at](uint64_t bytes) {
    const uint64_t here = at;
    at = Up(at + bytes);
    return here;
  };
  l.q = take(v.q_elems() * 2);
  l.kv_pool = take(v.kv_bytes());
  if (t == SendTransport::kShm) {
    l.kv_indptr = take((s.batch + 1) * 4);
    l.kv_indices = take(s.num_indices * 4);
    l.kv_lens = take(s.batch * 4);
    l.tree_mask = take(v.mask_bytes());
  }
  l.o = take(v.o_elems() * 2);
  l.lse = take(v.lse_elems() * 4);
  l.end = at;
  r->slot_bytes_ = at;
  r->o_bytes_ = uint64_t(v.o_elems()) * 2;
  r->bytes_ = at * static_cast<uint64_t>(slots);
  std::random_device rd;
  r->name_ = fmt::format("verifyctl-{}-{:08x}", getpid(), rd());
  if (absl::Status st = r->Allocate(device); !st.ok()) return st;
  if (absl::Status st = r->Register(device); !st.ok()) return st;
  return r;
}

absl::Status SendRegion::Allocate(int device) {
  device_index_ = device;
  if (transport_ == SendTransport::kShm) {
    shm_key_ = "/" + name_;
    const int fd = shm_open(shm_key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      return absl::InternalError(absl::StrCat("shm_open ", shm_key_, ": ", strerror(errno)));
    // A verifyd running as another user opens it through its socket's group (shm_object.h); where
    // that fails, verifyd's refusal to open the object says so.
    if (const std::optional<gid_t> group = SocketGroup(g_.target)) ShareWithGroup(fd, *group);
    if (ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      close(fd);
      shm_unlink(shm_key_.c_str());
      shm_key_.clear();
      return absl::ResourceExhaustedError(
          absl::StrCat("ftruncate ", shm_key_, ": ", strerror(errno)));
    }
    void* m = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return absl::ResourceExhaustedError("mmap of the shm region failed");
    host_ = static_cast<char*>(m);
    return absl::OkStatus();
  }
#ifdef VERIFYD_HAVE_CUDA
  // No driver, or no device visible: say so, not the runtime's "driver version is insufficient".
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--transport cuda_ipc: no usable GPU on this host (no NVIDIA driver loaded, or no device "
        "visible",
        e == cudaSuccess ? "" : absl::StrCat("; CUDA: ", cudaGetErrorString(e)),
        "); use --transport shm or inline"));
  }
  if (absl::Status st = Cuda(cudaSetDevice(device), "cudaSetDevice"); !st.ok()) return st;
  return Cuda(cudaMalloc(&device_, bytes_), "cudaMalloc of the cuda_ipc region");
#else
  return absl::FailedPreconditionError(
      "--transport cuda_ipc: this verifyctl was built without CUDA");
#endif
}

absl::Status SendRegion::Register(int device) {
  v1::RegisterRegionResponse resp;
  auto ctx = MakeContext(g_, false);
  grpc::Status st;
  if (transport_ == SendTransport::kShm) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name_);
    req.set_key(shm_key_);
    req.set_byte_size(bytes_);
    req.set_client(name_);
    st = stub_.RegisterShmRegion(ctx.get(), req, &resp);
  } else {
#ifdef VERIFYD_HAVE_CUDA
    cudaIpcMemHandle_t h;
    if (absl::Status cs = Cuda(cudaIpcGetMemHandle(&h, device_), "cudaIpcGetMemHandle"); !cs.ok()) {
      return cs;
    }
    v1::RegisterCudaRegionRequest req;
    req.set_name(name_);
    req.set_ipc_handle(reinterpret_cast<const char*>(&h), sizeof h);
    req.set_device(device);
    req.set_byte_size(bytes_);
    req.set_client(name_);
    st = stub_.RegisterCudaRegion(ctx.get(), req, &resp);
#else
    (void)device;
#endif
  }
  if (!st.ok()) return FromGrpc("registering the region", st);
  registered_ = true;
  return absl::OkStatus();
}

SendRegion::~SendRegion() {
  if (registered_) {
    v1::UnregisterRegionRequest req;
    req.set_name(name_);
    v1::UnregisterRegionResponse resp;
    auto ctx = MakeContext(g_, false);
    stub_.UnregisterRegion(ctx.get(), req, &resp);
  }
  if (host_ != nullptr) munmap(host_, bytes_);
  if (!shm_key_.empty()) shm_unlink(shm_key_.c_str());
#ifdef VERIFYD_HAVE_CUDA
  if (device_ != nullptr) cudaFree(device_);
#endif
}

absl::Status SendRegion::Put(uint64_t offset, const void* src, uint64_t bytes) {
  if (host_ != nullptr) {
    std::memcpy(host_ + offset, src, bytes);
    return absl::OkStatus();
  }
#ifdef VERIFYD_HAVE_CUDA
  // Synchronous: the write is complete before the call that reads it is sent.
  return Cuda(cudaMemcpy(static_cast<char*>(device_) + offset, src, bytes, cudaMemcpyHostToDevice),
              "writing the cuda_ipc region");
#else
  return absl::InternalError("no region memory");
#endif
}

void SendRegion::Ref(v1::Tensor* t, uint64_t offset, uint64_t bytes) const {
  t->clear_raw_contents();
  if (transport_ == SendTransport::kShm) {
    t->mutable_shm()->set_region(name_);
    t->mutable_shm()->set_offset(offset);
    t->mutable_shm()->set_byte_size(bytes);
  } else {
    t->mutable_cuda_ipc()->set_region(name_);
    t->mutable_cuda_ipc()->set_offset(offset);
    t->mutable_cuda_ipc()->set_byte_size(bytes);
  }
}

absl::Status SendRegion::Stage(int slot, const BundleView& v, v1::VerifyRequest* req) {
  const auto& s = v.shape;
  const uint64_t base = slot_bytes_ * static_cast<uint64_t>(slot);
  const Layout& l = layout_;
  struct Piece {
    v1::Tensor* t;
    uint64_t offset;
    const void* src;
    uint64_t bytes;
  };
  std::vector<Piece> pieces = {
      {req->mutable_q(), l.q, v.q, uint64_t(v.q_elems()) * 2},
      {req->mutable_kv_pool(), l.kv_pool, v.kv_pool, uint64_t(v.kv_bytes())}};
  if (transport_ == SendTransport::kShm) {
    pieces.push_back(
        {req->mutable_kv_indptr(), l.kv_indptr, v.kv_indptr, uint64_t(s.batch + 1) * 4});
    pieces.push_back(
        {req->mutable_kv_indices(), l.kv_indices, v.kv_indices, uint64_t(s.num_indices) * 4});
    pieces.push_back({req->mutable_kv_lens(), l.kv_lens, v.kv_lens, uint64_t(s.batch) * 4});
    pieces.push_back(
        {req->mutable_tree_mask(), l.tree_mask, v.tree_mask, uint64_t(v.mask_bytes())});
  }
  for (const Piece& p : pieces) {
    if (absl::Status st = Put(base + p.offset, p.src, p.bytes); !st.ok()) return st;
    Ref(p.t, base + p.offset, p.bytes);
  }
  v1::Tensor* o = req->mutable_o_out();
  o->set_dtype(v1::DTYPE_BF16);
  o->clear_shape();
  for (int64_t d : {v.rows(), int64_t{s.heads}, int64_t{kernels::kHeadDimV}}) o->add_shape(d);
  Ref(o, base + l.o, uint64_t(v.o_elems()) * 2);
  if (want_lse_) {
    v1::Tensor* lse = req->mutable_lse_out();
    lse->set_dtype(v1::DTYPE_F32);
    lse->clear_shape();
    lse->add_shape(v.rows());
    lse->add_shape(s.heads);
    Ref(lse, base + l.lse, uint64_t(v.lse_elems()) * 4);
  }
  return absl::OkStatus();
}

absl::Status SendRegion::Scribble(int slot) {
  const uint64_t at = slot_bytes_ * static_cast<uint64_t>(slot) + layout_.q;
  const uint64_t bytes = layout_.o - layout_.q;  // q, the pool (and, in shm, the indices)
  if (host_ != nullptr) {
    std::memset(host_ + at, 0xFF, bytes);
    return absl::OkStatus();
  }
#ifdef VERIFYD_HAVE_CUDA
  return Cuda(cudaMemset(static_cast<char*>(device_) + at, 0xFF, bytes), "scribbling");
#else
  return absl::InternalError("no region memory");
#endif
}

absl::StatusOr<std::string> SendRegion::Output(int slot) const {
  const uint64_t at = slot_bytes_ * static_cast<uint64_t>(slot) + layout_.o;
  std::string o(o_bytes_, '\0');
  if (host_ != nullptr) {
    std::memcpy(o.data(), host_ + at, o.size());
    return o;
  }
#ifdef VERIFYD_HAVE_CUDA
  if (absl::Status st = Cuda(
          cudaMemcpy(o.data(), static_cast<char*>(device_) + at, o.size(), cudaMemcpyDeviceToHost),
          "reading o");
      !st.ok()) {
    return st;
  }
  return o;
#else
  return absl::InternalError("no region memory");
#endif
}

}  // namespace verifyd::cli
