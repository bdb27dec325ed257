#pragma once
// A POSIX shared-memory object a test owns (created, mapped, unlinked at the end), and a
// bundle laid out in it as a client of the shm transport lays it out.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "src/bundle/bundle.h"
#include "src/bundle/random_bundle.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd::testing {

class ShmObject {
 public:
  ShmObject(const std::string& tag, size_t bytes)
      : key_("/vdtest-" + std::to_string(getpid()) + "-" + tag), bytes_(bytes) {
    shm_unlink(key_.c_str());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << key_ << ": " << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    data_ = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(data_, MAP_FAILED);
    close(fd);
  }
  ~ShmObject() {
    munmap(data_, bytes_);
    shm_unlink(key_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;
  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  std::string key_;
  size_t bytes_;
  char* data_ = nullptr;
};

// The bundles the region and channel suites send: 3 requests of 5 heads, odd sizes from the
// arguments, and 7 NaN-poisoned pages no request names (a whole-pool reader trips over them).
inline RandomBundleSpec RegionBundleSpec(uint64_t seed, int page_size, int draft, int64_t prefix) {
  RandomBundleSpec spec;
  spec.batch = 3;
  spec.draft = draft;
  spec.heads = 5;
  spec.prefix = prefix;
  spec.page_size = page_size;
  spec.seed = seed;
  spec.extra_pages = 7;
  return spec;
}

// Offsets of a bundle's tensors (and o, lse) in a region, each 64-byte aligned.
struct ShmLayout {
  size_t q = 0, kv_pool = 0, kv_indptr = 0, kv_indices = 0, kv_lens = 0, tree_mask = 0, o = 0,
         lse = 0, end = 0;
  static ShmLayout Of(const BundleView& v, size_t base = 0) {
    auto up = [](size_t x) { return (x + 63) / 64 * 64; };
    ShmLayout l;
    size_t at = base;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at = up(at + bytes);
      return here;
    };
    l.q = take(v.q_elems() * 2);
    l.kv_pool = take(v.kv_elems() * 2);
    l.kv_indptr = take((v.shape.batch + 1) * 4);
    l.kv_indices = take(v.shape.num_indices * 4);
    l.kv_lens = take(v.shape.batch * 4);
    l.tree_mask = take(v.mask_bytes());
    l.o = take(v.o_elems() * 2);
    l.lse = take(v.lse_elems() * 4);
    l.end = at;
    return l;
  }
};

inline void SetShm(v1::Tensor* t, const std::string& region, size_t offset, size_t bytes) {
  t->clear_raw_contents();
  t->mutable_shm()->set_region(region);
  t->mutable_shm()->set_offset(offset);
  t->mutable_shm()->set_byte_size(bytes);
}

// Copies `v` into `base` at `l`'s offsets and turns the inline request `req` (encoded from `v`)
// into one that names the region for every tensor, with o and lse written there.
inline void PutInShm(const BundleView& v, const ShmLayout& l, char* base, const std::string& region,
                     v1::VerifyRequest* req) {
  const auto& s = v.shape;
  std::memcpy(base + l.q, v.q, v.q_elems() * 2);
  std::memcpy(base + l.kv_pool, v.kv_pool, v.kv_elems() * 2);
  std::memcpy(base + l.kv_indptr, v.kv_indptr, (s.batch + 1) * 4);
  std::memcpy(base + l.kv_indices, v.kv_indices, s.num_indices * 4);
  std::memcpy(base + l.kv_lens, v.kv_lens, s.batch * 4);
  std::memcpy(base + l.tree_mask, v.tree_mask, v.mask_bytes());
  SetShm(req->mutable_q(), region, l.q, v.q_elems() * 2);
  SetShm(req->mutable_kv_pool(), region, l.kv_pool, v.kv_elems() * 2);
  SetShm(req->mutable_kv_indptr(), region, l.kv_indptr, (s.batch + 1) * 4);
  SetShm(req->mutable_kv_indices(), region, l.kv_indices, s.num_indices * 4);
  SetShm(req->mutable_kv_lens(), region, l.kv_lens, s.batch * 4);
  SetShm(req->mutable_tree_mask(), region, l.tree_mask, v.mask_bytes());
  v1::Tensor* o = req->mutable_o_out();
  o->set_dtype(v1::DTYPE_BF16);
  o->clear_shape();
  for (int64_t d : {v.rows(), int64_t{s.heads}, int64_t{kernels::kHeadDimV}}) o->add_shape(d);
  SetShm(o, region, l.o, v.o_elems() * 2);
  if (req->want_lse()) {
    v1::Tensor* lse = req->mutable_lse_out();
    lse->set_dtype(v1::DTYPE_F32);
    lse->clear_shape();
    lse->add_shape(v.rows());
    lse->add_shape(s.heads);
    SetShm(lse, region, l.lse, v.lse_elems() * 4);
  }
}

}  // namespace verifyd::testing
