// Decoding of verifyd.v1 requests: tensor shapes whose byte count does not fit in 64 bits are
// refused by name, without arithmetic overflow (the UBSan build checks the latter); tensors in a
// shared-memory region that decide what memory is read are copied out before they are checked.

#include <cstdint>
#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/bundle/validate.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd {
namespace {

RandomBundleSpec GoodSpec() {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 3;
  spec.heads = 8;
  spec.prefix = 54;
  spec.page_size = 16;
  return spec;
}

v1::VerifyRequest Good() {
  RandomBundle b(GoodSpec());
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

void SetShape(v1::Tensor* t, std::initializer_list<int64_t> dims) {
  t->clear_shape();
  for (int64_t d : dims) t->add_shape(d);
}

constexpr int64_t k2p40 = int64_t{1} << 40;

using verifyd::testing::PutInShm;
using verifyd::testing::ShmLayout;
using verifyd::testing::ShmObject;

// A client that shares the region could rewrite page ids or lengths after verifyd checked them;
// the checked copy is what the engines read. q and the pool are read in place.
TEST(RequestCodec, ShmIndicesAreCheckedCopiesAndValuesAreReadInPlace) {
  ShmObject shm("codec", 1 << 20);
  RegionRegistry regions(RegionLimits{}, nullptr);
  ASSERT_TRUE(regions.RegisterShm("r", shm.key(), 0, shm.size(), "test", Peer::Tcp("test")).ok());
  RandomBundle b(GoodSpec());
  const ShmLayout l = ShmLayout::Of(b.view());
  ASSERT_LE(l.end, shm.size());
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  PutInShm(b.view(), l, shm.data(), "r", &req);
  DecodedRequest d;
  ASSERT_TRUE(DecodeRequest(req, &regions, Peer::Tcp("test"), &d).ok());
  const BundleView& v = d.view;
  const auto& s = b.view().shape;
  // Values are read where they are: the client's writes show (it must finish them first).
  reinterpret_cast<uint16_t*>(shm.data() + l.q)[0] ^= 0x8000;
  reinterpret_cast<uint16_t*>(shm.data() + l.kv_pool)[5] ^= 0x8000;
  EXPECT_EQ(v.q[0], b.view().q[0] ^ 0x8000);
  EXPECT_EQ(static_cast<const uint16_t*>(v.kv_pool)[5], b.kv_pool[5] ^ 0x8000);
  // The client rewrites every page id past the pool, every length past its pages, the mask and
  // the offsets: none of it reaches the checked bundle.
  auto* ids = reinterpret_cast<int32_t*>(shm.data() + l.kv_indices);
  for (int64_t i = 0; i < s.num_indices; ++i) ids[i] = static_cast<int32_t>(s.num_pages + 1000);
  auto* lens = reinterpret_cast<int32_t*>(shm.data() + l.kv_lens);
  for (int i = 0; i < s.batch; ++i) lens[i] = 1 << 30;
  std::memset(shm.data() + l.kv_indptr, 0x7f, (s.batch + 1) * 4);
  std::memset(shm.data() + l.tree_mask, 0, b.view().mask_bytes());
  for (int i = 0; i <= s.batch; ++i) EXPECT_EQ(v.kv_indptr[i], b.view().kv_indptr[i]);
  EXPECT_EQ(std::memcmp(v.tree_mask, b.view().tree_mask, b.view().mask_bytes()), 0);
  for (int64_t i = 0; i < s.num_indices; ++i) EXPECT_EQ(v.kv_indices[i], b.view().kv_indices[i]);
  for (int i = 0; i < s.batch; ++i) EXPECT_EQ(v.kv_lens[i], b.view().kv_lens[i]);
  BundleView again = v;
  EXPECT_TRUE(ValidateBundle(again).ok());
}

TEST(RequestCodec, GoodRequestDecodesToViewOfTheRequestBytes) {
  const v1::VerifyRequest req = Good();
  absl::StatusOr<BundleView> v = DecodeRequest(req);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(static_cast<const void*>(v->q), req.q().raw_contents().data());
  EXPECT_EQ(static_cast<const void*>(v->kv_pool), req.kv_pool().raw_contents().data());
}

TEST(RequestCodec, ShapeWhoseByteCountOverflowsIsRefusedByName) {
  struct Case {
    const char* field;
    v1::Tensor* (v1::VerifyRequest::*tensor)();
    std::initializer_list<int64_t> dims;
  };
  const Case cases[] = {
      {"q", &v1::VerifyRequest::mutable_q, {k2p40, k2p40, 576}},
      {"q", &v1::VerifyRequest::mutable_q, {k2p40, 2, k2p40}},
      {"kv_pool", &v1::VerifyRequest::mutable_kv_pool, {k2p40, k2p40, k2p40}},
      {"tree_mask", &v1::VerifyRequest::mutable_tree_mask, {2, k2p40, k2p40}},
      {"kv_indices", &v1::VerifyRequest::mutable_kv_indices, {k2p40}},  // fits: a size mismatch
  };
  for (const Case& c : cases) {
    v1::VerifyRequest req = Good();
    SetShape((req.*c.tensor)(), c.dims);
    absl::StatusOr<BundleView> v = DecodeRequest(req);
    ASSERT_FALSE(v.ok());
    const std::string msg(v.status().message());
    SCOPED_TRACE(msg);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(msg.rfind(std::string(c.field) + ": ", 0), 0u);
    if (std::string(c.field) == "kv_indices") {
      EXPECT_NE(msg.find("expected 4398046511104"), std::string::npos);
    } else {
      EXPECT_NE(msg.find("has more than 2^63 bytes"), std::string::npos);
    }
  }
}

TEST(RequestCodec, AZeroDimensionMakesAnEmptyTensorEvenAfterLargeOnes) {
  v1::VerifyRequest req = Good();
  SetShape(req.mutable_q(), {k2p40, k2p40, 0});
  absl::StatusOr<BundleView> v = DecodeRequest(req);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("expected 0"), std::string::npos) << v.status();
}

}  // namespace
}  // namespace verifyd
