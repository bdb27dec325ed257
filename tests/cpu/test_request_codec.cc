// Decoding of verifyd.v1 requests: tensor shapes whose byte count does not fit in 64 bits are
// refused by name, without arithmetic overflow (the UBSan build checks the latter).

#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"

namespace verifyd {
namespace {

v1::VerifyRequest Good() {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 3;
  spec.heads = 8;
  spec.prefix = 54;
  spec.page_size = 16;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

void SetShape(v1::Tensor* t, std::initializer_list<int64_t> dims) {
  t->clear_shape();
  for (int64_t d : dims) t->add_shape(d);
}

constexpr int64_t k2p40 = int64_t{1} << 40;

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
