#pragma once
// A verify-attention bundle on the host: the tensors of the contract (README.md, "The computation")
// as typed views.

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/e4m3.h"
#include "kernels/verify_problem.h"
#include "src/common/bf16.h"

namespace verifyd {

// Non-owning, host memory. Only Validate() (bundle/validate.h) produces one that engines accept.
struct BundleView {
  kernels::ProblemShape shape;
  const uint16_t* q = nullptr;  // bf16 [B*T, H, 576]
  // [num_pages, page_size, 576] of shape.kv_dtype: bf16, or e4m3 bytes whose values are
  // e4m3 x kv_scale.
  const void* kv_pool = nullptr;
  const int32_t* kv_indptr = nullptr;   // [B+1]
  const int32_t* kv_indices = nullptr;  // [kv_indptr[B]]
  const int32_t* kv_lens = nullptr;     // [B]
  const uint8_t* tree_mask = nullptr;   // [B, T, T] bytes or [B, T, ceil(T/8)] bits
  float sm_scale = 0.f;
  float kv_scale = 1.f;  // an e4m3 pool's scale; 1 for a bf16 pool
  // The reference and custom paths multiply o by this before they round it: an e4m3 pool's
  // kv_scale, moved out of the pool by DequantizedBundle. 1 in every other view.
  float o_scale = 1.f;
  int64_t max_kv_len = 0;    // filled by Validate()
  int64_t total_kv_len = 0;  // filled by Validate()
  // Where q and kv_pool are: -1 for host memory (inline bytes or a shm region), else the GPU of
  // the CUDA IPC region the CUDA engine reads them from in place.
  int q_device = -1;
  int kv_pool_device = -1;
  // Where kv_indices and tree_mask are: -1 for host memory, whose contents ValidateBundle checks.
  // Else the GPU whose memory holds both (CUDA IPC or VMM regions, with the pool on it too):
  // ValidateBundle leaves their contents to the engine, which checks them on that GPU as it
  // copies them (Engine::InputChecks says the outcome).
  int indices_device = -1;
  // kv_pool is a registered region the client keeps writing: a copy of the bundle takes only the
  // pages kv_indices names (see OwnedBundle).
  bool kv_pool_shared = false;
  // Names the call's layout (kv_indptr, kv_lens, kv_indices and tree_mask), 0 for none: calls
  // with the same nonzero key and the same layout tensors say that their layouts are the same, so
  // an engine that copied and checked one on a GPU (indices_device) may let later calls read that
  // copy. Doorbell channels set it from a layout slot's generation (doorbell_layout.h).
  uint64_t layout_key = 0;

  bool on_host() const { return q_device < 0 && kv_pool_device < 0 && indices_device < 0; }

  int64_t rows() const { return int64_t{shape.batch} * shape.draft; }  // B*T
  int64_t q_elems() const { return rows() * shape.heads * kernels::kHeadDimQK; }
  int64_t o_elems() const { return rows() * shape.heads * kernels::kHeadDimV; }
  int64_t lse_elems() const { return rows() * shape.heads; }
  int64_t kv_elems() const { return shape.num_pages * shape.page_size * kernels::kHeadDimQK; }
  int64_t kv_elem_bytes() const { return kernels::KvElemBytes(shape.kv_dtype); }
  int64_t kv_bytes() const { return kv_elems() * kv_elem_bytes(); }
  int64_t page_bytes() const {
    return int64_t{shape.page_size} * kernels::kHeadDimQK * kv_elem_bytes();
  }
  int64_t mask_bytes() const {
    return rows() * kernels::MaskRowBytes(shape.mask_format, shape.draft);
  }
  // Whether draft token i of request b may see draft token j.
  bool MaskBit(int b, int i, int j) const {
    const uint8_t* row = tree_mask + (int64_t{b} * shape.draft + i) *
                                         kernels::MaskRowBytes(shape.mask_format, shape.draft);
    return shape.mask_format == kernels::MaskFormat::kBytes ? row[j] != 0
                                                            : ((row[j >> 3] >> (j & 7)) & 1) != 0;
  }
  // Index of token t of request b's row in the pool, in units of 576 elements.
  int64_t KvSlot(int b, int64_t t) const {
    const int64_t page = kv_indices[kv_indptr[b] + t / shape.page_size];
    return page * shape.page_size + t % shape.page_size;
  }
  // The 576 dims of token t of request b, in a bf16 pool.
  const uint16_t* KvRow(int b, int64_t t) const {
    return static_cast<const uint16_t*>(kv_pool) + KvSlot(b, t) * kernels::kHeadDimQK;
  }
  // The first `dims` values of that row as fp32, from either pool type: an e4m3 pool's dequantised
  // to e4m3 x kv_scale in fp32 (the oracle's reading).
  void KvRowFloat(int b, int64_t t, int dims, float* out) const {
    if (shape.kv_dtype == kernels::KvDtype::kE4m3) {
      const uint8_t* row =
          static_cast<const uint8_t*>(kv_pool) + KvSlot(b, t) * kernels::kHeadDimQK;
      for (int d = 0; d < dims; ++d) out[d] = kernels::E4m3ToFloat(row[d]) * kv_scale;
    } else {
      const uint16_t* row = KvRow(b, t);
      for (int d = 0; d < dims; ++d) out[d] = Bf16ToFloat(row[d]);
    }
  }
};

// A deep copy of a bundle, for work that outlives the request that carried it. From a shared
// pool (kv_pool_shared) it copies only the pages kv_indices names, in that order, and renumbers
// kv_indices 0, 1, ...: the same attention on a compact pool.
class OwnedBundle {
 public:
  explicit OwnedBundle(const BundleView& v);  // v.on_host()
  // The bytes OwnedBundle(v) allocates for its copy.
  static int64_t BytesFor(const BundleView& v);
  // Storage sized for `shape_of`'s shape and scalars, tensors left zero for the caller to fill
  // through the mutable accessors (a device-to-host copy lands here directly).
  struct Sized {};
  OwnedBundle(const BundleView& shape_of, Sized);
  const BundleView& view() const { return view_; }

  uint16_t* mutable_q() { return q_.data(); }
  void* mutable_kv_pool() { return kv_pool_.data(); }
  int32_t* mutable_kv_indptr() { return kv_indptr_.data(); }
  int32_t* mutable_kv_indices() { return kv_indices_.data(); }
  int32_t* mutable_kv_lens() { return kv_lens_.data(); }
  uint8_t* mutable_tree_mask() { return tree_mask_.data(); }

 private:
  std::vector<uint16_t> q_;
  std::vector<uint8_t> kv_pool_;  // the pool's bytes, of either element type
  std::vector<int32_t> kv_indptr_, kv_indices_, kv_lens_;
  std::vector<uint8_t> tree_mask_;
  BundleView view_;

  void PointViewAtStorage();
};

}  // namespace verifyd
