#include "src/bundle/request_codec.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/bundle/validate.h"
#include "src/common/proto_tensors.h"
#include "src/common/status_macros.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;

std::string ShapeStr(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

int64_t ShapeBytes(const char* name, const v1::Tensor& t, v1::DType dtype, int rank,
                   absl::Status* st) {
  if (t.dtype() != dtype) {
    *st = absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", v1::DType_Name(t.dtype()),
                                                  ", expected ", v1::DType_Name(dtype)));
    return 0;
  }
  if (t.shape_size() != rank) {
    *st = absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeStr(t), " has rank ",
                                                  t.shape_size(), ", expected ", rank));
    return 0;
  }
  int64_t n = DTypeBytes(dtype);
  bool overflow = false;
  for (int64_t d : t.shape()) {
    if (d < 0 || d > (int64_t{1} << 40)) {
      *st =
          absl::InvalidArgumentError(absl::StrCat(name, ": bad dimension in shape ", ShapeStr(t)));
      return 0;
    }
    overflow = overflow || __builtin_mul_overflow(n, d, &n);
  }
  if (overflow && !absl::c_linear_search(t.shape(), 0)) {
    *st = absl::InvalidArgumentError(
        absl::StrCat(name, ": shape ", ShapeStr(t), " has more than 2^63 bytes"));
    return 0;
  }
  return overflow ? 0 : n;
}

// Where a request's tensors are: inline bytes or a range of a registered region.
class TensorLocator {
 public:
  TensorLocator(const v1::VerifyRequest& req, const RegionRegistry* regions, const Peer& caller,
                DecodedRequest* out)
      : req_(req), regions_(regions), caller_(caller), out_(out) {}

  // The range a region tensor names, checked and pinned; the region on the request's device
  // when it is a GPU's.
  absl::StatusOr<RegionRange> Region(const char* name, const v1::Tensor& t, int64_t want) {
    const bool shm = t.contents_case() == v1::Tensor::kShm;
    const RegionName which =
        shm ? RegionName{t.shm().region(), t.shm().set(), t.shm().index()}
            : RegionName{t.cuda_ipc().region(), t.cuda_ipc().set(), t.cuda_ipc().index()};
    const std::string& region = which.set.empty() ? which.name : which.set;
    const uint64_t offset = shm ? t.shm().offset() : t.cuda_ipc().offset();
    const uint64_t size = shm ? t.shm().byte_size() : t.cuda_ipc().byte_size();
    if (size != static_cast<uint64_t>(want)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": byte_size ", size, " for shape ",
                                                     ShapeStr(t), ", expected ", want));
    }
    if (regions_ == nullptr) {
      return absl::NotFoundError(absl::StrCat(name, ": region '", region,
                                              "' is not registered (no regions are served here)"));
    }
    absl::StatusOr<RegionRange> r =
        regions_->Resolve(name, shm ? RegionKind::kShm : RegionKind::kCudaIpc, which, offset, size,
                          &out_->pins, caller_);
    if (!r.ok()) return r.status();
    named_.push_back({name, r->label, *r});
    if (r->device() >= 0 && r->device() != req_.device()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": region '", *r->label,
                                                     "' is on device ", r->device(),
                                                     ", the request's device is ", req_.device()));
    }
    return r;
  }

  // Checks presence, dtype, rank and byte size. Returns where the bytes are, and sets `*device`
  // to the GPU they are on (-1: host). Without `device` (the indices, lengths and mask), bytes in
  // a region are copied into verifyd's own memory first: they are checked there, and the client
  // that shares the region cannot change them between the check and the kernels (a page id past
  // the pool after the check would be read).
  // `elsewhere`: the inline bytes when the message does not hold them (ParseRequestInPlace).
  absl::StatusOr<const void*> Locate(const char* name, const v1::Tensor& t, v1::DType dtype,
                                     int rank, int* device = nullptr,
                                     const std::optional<absl::string_view>* elsewhere = nullptr) {
    if (t.contents_case() == v1::Tensor::CONTENTS_NOT_SET) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": missing tensor"));
    }
    absl::Status st;
    const int64_t n = ShapeBytes(name, t, dtype, rank, &st);
    if (!st.ok()) return st;
    if (device != nullptr) *device = -1;
    if (t.contents_case() == v1::Tensor::kRawContents) {
      const absl::string_view raw =
          elsewhere != nullptr && elsewhere->has_value() && t.raw_contents().empty()
              ? **elsewhere
              : absl::string_view(t.raw_contents());
      if (static_cast<int64_t>(raw.size()) != n) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": ", raw.size(), " bytes for shape ",
                                                       ShapeStr(t), ", expected ", n));
      }
      return static_cast<const void*>(raw.data());
    }
    absl::StatusOr<RegionRange> r = Region(name, t, n);
    if (!r.ok()) return r.status();
    if (device != nullptr) {
      *device = r->device();
      return static_cast<const void*>(r->data);
    }
    return HostCopy(name, *r);
  }

  // kv_indices or tree_mask: where a GPU's region holds them (*device: that GPU), left for the
  // engine to check there; else as Locate() without `device` (host bytes, a region's copied).
  absl::StatusOr<const void*> LocateChecked(const char* name, const v1::Tensor& t, v1::DType dtype,
                                            int rank, int* device) {
    VERIFYD_ASSIGN_OR_RETURN(const void* p, Locate(name, t, dtype, rank, device));
    const bool region =
        t.contents_case() == v1::Tensor::kShm || t.contents_case() == v1::Tensor::kCudaIpc;
    if (*device >= 0 || !region) return p;
    return HostCopy(name);
  }

  // The bytes of `name`'s region range (located before) copied into verifyd's memory: checked
  // there, out of reach of the client that shares the region.
  absl::StatusOr<const void*> HostCopy(const char* name) {
    for (auto it = named_.rbegin(); it != named_.rend(); ++it) {
      if (std::strcmp(it->name, name) == 0) return HostCopy(name, it->range);
    }
    return absl::InternalError(absl::StrCat(name, ": not located in a region"));
  }

  // An output target: a region tensor with the output's dtype and shape.
  absl::StatusOr<RegionRange> Output(const char* name, const v1::Tensor& t, v1::DType dtype,
                                     const std::vector<int64_t>& shape) {
    if (t.contents_case() != v1::Tensor::kShm && t.contents_case() != v1::Tensor::kCudaIpc) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must name a shm or cuda_ipc region (no inline bytes)"));
    }
    absl::Status st;
    const int64_t n = ShapeBytes(name, t, dtype, static_cast<int>(shape.size()), &st);
    if (!st.ok()) return st;
    if (!absl::c_equal(t.shape(), shape)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeStr(t), ", expected [",
                                                     absl::StrJoin(shape, ", "), "]"));
    }
    absl::StatusOr<RegionRange> r = Region(name, t, n);
    if (!r.ok()) return r.status();
    // verifyd writes here after the served path, and a comparison run then (compare_sync) would
    // read the output where its inputs were.
    for (size_t i = 0; i + 1 < named_.size(); ++i) {  // the last one is this output
      const Named& other = named_[i];
      if (other.range.region != r->region) continue;
      if (r->offset < other.range.offset + other.range.byte_size &&
          other.range.offset < r->offset + r->byte_size) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": bytes [", r->offset, ", ", r->offset + r->byte_size,
                         ") of region '", *other.region, "' overlap ", other.name, "'s [",
                         other.range.offset, ", ", other.range.offset + other.range.byte_size,
                         "); outputs must not overlap the inputs or each other"));
      }
    }
    return r;
  }

 private:
  absl::StatusOr<const void*> HostCopy(const char* name, const RegionRange& r) {
    std::vector<char>& copy = out_->host_copies.emplace_back(std::max<size_t>(r.byte_size, 1));
    if (absl::Status rs = r.region->ReadToHost(r.offset, r.byte_size, copy.data()); !rs.ok()) {
      return absl::Status(rs.code(),
                          absl::StrCat(name, ": reading it from its region: ", rs.message()));
    }
    return static_cast<const void*>(copy.data());
  }

  struct Named {  // a range of a region the call names
    const char* name;
    const std::string* region;
    RegionRange range;
  };

  const v1::VerifyRequest& req_;
  const RegionRegistry* regions_;
  const Peer& caller_;
  DecodedRequest* out_;
  std::vector<Named> named_;
};

absl::Status DimIs(const char* name, const v1::Tensor& t, int axis, int64_t want,
                   const char* what) {
  if (t.shape(axis) != want) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeStr(t), " dim ", axis,
                                                   " is ", t.shape(axis), ", expected ", want, " (",
                                                   what, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRequest(const v1::VerifyRequest& req, const RegionRegistry* regions,
                           const Peer& caller, DecodedRequest* out,
                           const InPlaceTensors* in_place) {
  *out = DecodedRequest();
  TensorLocator at(req, regions, caller, out);
  BundleView& v = out->view;
  const void* p;
  // kv_lens fixes B; tree_mask fixes T; q fixes H; kv_pool fixes the pool.
  VERIFYD_ASSIGN_OR_RETURN(p, at.Locate("kv_lens", req.kv_lens(), v1::DTYPE_I32, 1));
  v.kv_lens = static_cast<const int32_t*>(p);
  const int64_t batch = req.kv_lens().shape(0);
  if (batch < 1 || batch > kernels::kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_lens: batch ", batch, " is outside [1, ", kernels::kMaxBatch, "]"));
  }
  VERIFYD_ASSIGN_OR_RETURN(p, at.Locate("kv_indptr", req.kv_indptr(), v1::DTYPE_I32, 1));
  v.kv_indptr = static_cast<const int32_t*>(p);
  VERIFYD_RETURN_IF_ERROR(DimIs("kv_indptr", req.kv_indptr(), 0, batch + 1, "B + 1"));
  int indices_device = -1, mask_device = -1;
  VERIFYD_ASSIGN_OR_RETURN(
      p, at.LocateChecked("kv_indices", req.kv_indices(), v1::DTYPE_I32, 1, &indices_device));
  v.kv_indices = static_cast<const int32_t*>(p);

  if (req.mask_format() != v1::MASK_FORMAT_BYTES && req.mask_format() != v1::MASK_FORMAT_BITS) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask_format: unknown value ", static_cast<int>(req.mask_format())));
  }
  const auto mask_format = req.mask_format() == v1::MASK_FORMAT_BITS ? kernels::MaskFormat::kBits
                                                                     : kernels::MaskFormat::kBytes;
  VERIFYD_ASSIGN_OR_RETURN(
      p, at.LocateChecked("tree_mask", req.tree_mask(), v1::DTYPE_U8, 3, &mask_device));
  v.tree_mask = static_cast<const uint8_t*>(p);
  VERIFYD_RETURN_IF_ERROR(DimIs("tree_mask", req.tree_mask(), 0, batch, "B"));
  const int64_t draft = req.tree_mask().shape(1);
  if (draft < 1 || draft > kernels::kMaxDraft) {
    return absl::InvalidArgumentError(absl::StrCat("tree_mask: draft length T = ", draft,
                                                   " is outside [1, ", kernels::kMaxDraft, "]"));
  }
  VERIFYD_RETURN_IF_ERROR(DimIs("tree_mask", req.tree_mask(), 2,
                                kernels::MaskRowBytes(mask_format, static_cast<int>(draft)),
                                mask_format == kernels::MaskFormat::kBytes ? "T" : "ceil(T/8)"));

  VERIFYD_ASSIGN_OR_RETURN(p, at.Locate("q", req.q(), v1::DTYPE_BF16, 3, &v.q_device,
                                        in_place != nullptr ? &in_place->q : nullptr));
  v.q = static_cast<const uint16_t*>(p);
  VERIFYD_RETURN_IF_ERROR(DimIs("q", req.q(), 0, batch * draft, "B*T"));
  VERIFYD_RETURN_IF_ERROR(DimIs("q", req.q(), 2, kHeadDimQK, "576 = 512 latent + 64 rope"));
  const int64_t heads = req.q().shape(1);
  if (heads < 1 || heads > kernels::kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("q: heads H = ", heads, " is outside [1, ", kernels::kMaxHeads, "]"));
  }
  const v1::Tensor& pool = req.kv_pool();
  if (pool.dtype() != v1::DTYPE_BF16 && pool.dtype() != v1::DTYPE_F8E4M3 &&
      pool.contents_case() != v1::Tensor::CONTENTS_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat("kv_pool: dtype ", v1::DType_Name(pool.dtype()),
                                                   ", expected DTYPE_BF16 or DTYPE_F8E4M3"));
  }
  const bool e4m3 = pool.dtype() == v1::DTYPE_F8E4M3;
  v.shape.kv_dtype = e4m3 ? kernels::KvDtype::kE4m3 : kernels::KvDtype::kBf16;
  const char* elem = kernels::KvDtypeName(v.shape.kv_dtype);
  if (pool.shape_size() == 3 && pool.shape(1) > 0 &&
      (pool.contents_case() == v1::Tensor::kShm || pool.contents_case() == v1::Tensor::kCudaIpc)) {
    // A registered pool is named whole: a whole number of pages of page_size x 576 elements.
    const uint64_t page_bytes =
        static_cast<uint64_t>(pool.shape(1)) * kHeadDimQK * kernels::KvElemBytes(v.shape.kv_dtype);
    const uint64_t bytes = pool.contents_case() == v1::Tensor::kShm ? pool.shm().byte_size()
                                                                    : pool.cuda_ipc().byte_size();
    if (bytes % page_bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_pool: byte_size ", bytes, " is not a whole number of pages of ",
                       page_bytes, " bytes (page_size ", pool.shape(1), " x 576 ", elem, ")"));
    }
    v.kv_pool_shared = true;
  }
  VERIFYD_ASSIGN_OR_RETURN(
      p, at.Locate("kv_pool", req.kv_pool(), e4m3 ? v1::DTYPE_F8E4M3 : v1::DTYPE_BF16, 3,
                   &v.kv_pool_device, in_place != nullptr ? &in_place->kv_pool : nullptr));
  v.kv_pool = p;
  VERIFYD_RETURN_IF_ERROR(DimIs("kv_pool", req.kv_pool(), 2, kHeadDimQK, "576"));
  const int64_t page_size = req.kv_pool().shape(1);
  if (page_size < 1 || page_size > kernels::kMaxPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_pool: page_size ", page_size, " is not a power of two in [1, 128]"));
  }

  // Page ids and mask are checked on the GPU when it holds them and the pool (all region tensors
  // are on the request's device); otherwise here, from host copies.
  if (indices_device >= 0 && mask_device >= 0 && v.kv_pool_device >= 0) {
    v.indices_device = indices_device;
  } else {
    if (indices_device >= 0) {
      VERIFYD_ASSIGN_OR_RETURN(p, at.HostCopy("kv_indices"));
      v.kv_indices = static_cast<const int32_t*>(p);
    }
    if (mask_device >= 0) {
      VERIFYD_ASSIGN_OR_RETURN(p, at.HostCopy("tree_mask"));
      v.tree_mask = static_cast<const uint8_t*>(p);
    }
  }

  v.shape.batch = static_cast<int>(batch);
  v.shape.draft = static_cast<int>(draft);
  v.shape.heads = static_cast<int>(heads);
  v.shape.page_size = static_cast<int>(page_size);
  v.shape.num_pages = req.kv_pool().shape(0);
  v.shape.num_indices = req.kv_indices().shape(0);
  v.shape.mask_format = mask_format;
  v.sm_scale = req.sm_scale();
  if (req.has_kv_scale()) v.kv_scale = req.kv_scale();
  VERIFYD_RETURN_IF_ERROR(ValidateBundle(v));

  if (req.has_o_out()) {
    VERIFYD_ASSIGN_OR_RETURN(out->o_out, at.Output("o_out", req.o_out(), v1::DTYPE_BF16,
                                                   {v.rows(), heads, kernels::kHeadDimV}));
  }
  if (req.has_lse_out()) {
    if (!req.want_lse()) {
      return absl::InvalidArgumentError("lse_out: set, but want_lse is false");
    }
    if (!req.has_o_out()) {
      return absl::InvalidArgumentError(
          "lse_out: set without o_out (both go to regions or "
          "neither)");
    }
    VERIFYD_ASSIGN_OR_RETURN(out->lse_out,
                             at.Output("lse_out", req.lse_out(), v1::DTYPE_F32, {v.rows(), heads}));
  } else if (req.has_o_out() && req.want_lse()) {
    return absl::InvalidArgumentError("lse_out: want_lse with o_out needs lse_out too");
  }
  return absl::OkStatus();
}

absl::StatusOr<BundleView> DecodeRequest(const v1::VerifyRequest& req) {
  DecodedRequest d;
  if (absl::Status st = DecodeRequest(req, nullptr, Peer(), &d); !st.ok()) return st;
  if (!d.host_copies.empty() || d.o_out) {
    return absl::FailedPreconditionError("request: names regions; decode it with a registry");
  }
  return d.view;
}

namespace {

void SetRaw(v1::DType dtype, const std::vector<int64_t>& shape, const void* data, int64_t bytes,
            v1::Tensor* t) {
  t->set_dtype(dtype);
  t->clear_shape();
  for (int64_t d : shape) t->add_shape(d);
  t->set_raw_contents(data, static_cast<size_t>(bytes));
}

int64_t Count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void EncodeBf16(const std::vector<int64_t>& shape, const uint16_t* data, v1::Tensor* t) {
  SetRaw(v1::DTYPE_BF16, shape, data, Count(shape) * 2, t);
}

void EncodeF32(const std::vector<int64_t>& shape, const float* data, v1::Tensor* t) {
  SetRaw(v1::DTYPE_F32, shape, data, Count(shape) * 4, t);
}

void EncodeRequest(const BundleView& v, v1::VerifyRequest* req, InPlaceTensors* bulk) {
  const auto& s = v.shape;
  const bool e4m3 = s.kv_dtype == kernels::KvDtype::kE4m3;
  for (auto [t, data, dtype, shape, in_place] :
       {std::tuple{req->mutable_q(), static_cast<const void*>(v.q), v1::DTYPE_BF16,
                   std::vector<int64_t>{v.rows(), s.heads, kHeadDimQK}, bulk ? &bulk->q : nullptr},
        std::tuple{req->mutable_kv_pool(), v.kv_pool, e4m3 ? v1::DTYPE_F8E4M3 : v1::DTYPE_BF16,
                   std::vector<int64_t>{s.num_pages, s.page_size, kHeadDimQK},
                   bulk ? &bulk->kv_pool : nullptr}}) {
    const int64_t bytes = Count(shape) * DTypeBytes(dtype);
    SetRaw(dtype, shape, in_place ? static_cast<const void*>("") : data, in_place ? 0 : bytes, t);
    if (in_place) *in_place = absl::string_view(static_cast<const char*>(data), bytes);
  }
  if (e4m3) {
    req->set_kv_scale(v.kv_scale);
  } else {
    req->clear_kv_scale();
  }
  SetRaw(v1::DTYPE_I32, {s.batch + 1}, v.kv_indptr, (s.batch + 1) * 4, req->mutable_kv_indptr());
  SetRaw(v1::DTYPE_I32, {s.num_indices}, v.kv_indices, s.num_indices * 4,
         req->mutable_kv_indices());
  SetRaw(v1::DTYPE_I32, {s.batch}, v.kv_lens, s.batch * 4, req->mutable_kv_lens());
  const int64_t row_bytes = kernels::MaskRowBytes(s.mask_format, s.draft);
  SetRaw(v1::DTYPE_U8, {s.batch, s.draft, row_bytes}, v.tree_mask, v.mask_bytes(),
         req->mutable_tree_mask());
  req->set_mask_format(s.mask_format == kernels::MaskFormat::kBits ? v1::MASK_FORMAT_BITS
                                                                   : v1::MASK_FORMAT_BYTES);
  req->set_sm_scale(v.sm_scale);
}

}  // namespace verifyd
