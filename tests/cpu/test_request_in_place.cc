// ParseRequestInPlace: the parse of a call channel's request. It must give what protobuf's parse
// gives for every input (random requests of odd sizes, merged and unknown fields, truncated and
// corrupted bytes), with q's and kv_pool's inline bytes left in the message's memory and
// everything else, above all what verifyd checks, copied out of it.

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/bundle/request_in_place.h"

namespace verifyd {
namespace {

bool Inside(absl::string_view wire, const void* p) {
  const char* c = static_cast<const char*>(p);
  return c >= wire.data() && c < wire.data() + wire.size();
}

// `req` with the in-place bytes put back: what protobuf's own parse gives.
v1::VerifyRequest Restored(v1::VerifyRequest req, const InPlaceTensors& bulk) {
  if (bulk.q) req.mutable_q()->set_raw_contents(std::string(*bulk.q));
  if (bulk.kv_pool) req.mutable_kv_pool()->set_raw_contents(std::string(*bulk.kv_pool));
  return req;
}

// Parses `wire` both ways; they must agree on success and on the message.
void ExpectSameAsProtobuf(const std::string& wire) {
  v1::VerifyRequest whole, req;
  InPlaceTensors bulk;
  const bool ok = whole.ParseFromString(wire);
  ASSERT_EQ(ParseRequestInPlace(wire, &req, &bulk), ok);
  if (!ok) {
    EXPECT_FALSE(bulk.q || bulk.kv_pool) << "a refused message names no bulk";
    return;
  }
  EXPECT_EQ(Restored(req, bulk).SerializeAsString(), whole.SerializeAsString());
  for (const auto& b : {bulk.q, bulk.kv_pool}) {
    if (b) {
      EXPECT_TRUE(b->empty() || Inside(wire, b->data()));
    }
  }
}

// B, T, H, prefix, page size, seed.
RandomBundleSpec Spec(int b, int t, int h, int64_t prefix, int page, uint64_t seed) {
  RandomBundleSpec s;
  std::tie(s.batch, s.draft, s.heads, s.prefix, s.page_size, s.seed) =
      std::tie(b, t, h, prefix, page, seed);
  return s;
}

// Bundles of odd sizes, page 1 to 128, seeded from `seed` on.
std::vector<RandomBundleSpec> OddSpecs(uint64_t seed) {
  return {Spec(1, 1, 1, 1, 1, seed), Spec(3, 5, 7, 37, 4, seed + 1),
          Spec(2, 16, 16, 300, 64, seed + 2), Spec(5, 3, 2, 129, 128, seed + 3)};
}

TEST(RequestInPlace, RandomRequestsLeaveOnlyTheBulkInPlace) {
  for (const RandomBundleSpec& spec : OddSpecs(1)) {
    RandomBundle b(spec);
    v1::VerifyRequest sent;
    EncodeRequest(b.view(), &sent);
    sent.set_request_id("call-7");
    sent.set_want_lse(true);
    const std::string wire = sent.SerializeAsString();
    v1::VerifyRequest req;
    InPlaceTensors bulk;
    ASSERT_TRUE(ParseRequestInPlace(wire, &req, &bulk));
    ASSERT_TRUE(bulk.q && bulk.kv_pool);
    EXPECT_EQ(*bulk.q, sent.q().raw_contents());
    EXPECT_EQ(*bulk.kv_pool, sent.kv_pool().raw_contents());
    EXPECT_TRUE(Inside(wire, bulk.q->data()));
    EXPECT_TRUE(Inside(wire, bulk.kv_pool->data()));
    EXPECT_TRUE(req.q().raw_contents().empty());
    EXPECT_EQ(req.q().contents_case(), v1::Tensor::kRawContents);
    EXPECT_EQ(Restored(req, bulk).SerializeAsString(), wire);

    // What the checks read is verifyd's own copy; the view reads q and the pool in place.
    DecodedRequest d;
    ASSERT_TRUE(DecodeRequest(req, nullptr, Peer(), &d, &bulk).ok());
    EXPECT_TRUE(Inside(wire, d.view.q));
    EXPECT_TRUE(Inside(wire, d.view.kv_pool));
    for (const void* checked :
         {static_cast<const void*>(d.view.kv_indptr), static_cast<const void*>(d.view.kv_indices),
          static_cast<const void*>(d.view.kv_lens), static_cast<const void*>(d.view.tree_mask)}) {
      EXPECT_FALSE(Inside(wire, checked));
    }
    absl::StatusOr<BundleView> whole = DecodeRequest(sent);
    ASSERT_TRUE(whole.ok());
    EXPECT_EQ(d.view.shape.num_pages, whole->shape.num_pages);
    EXPECT_EQ(0, std::memcmp(d.view.q, whole->q, size_t(whole->q_elems()) * 2));
  }
}

TEST(RequestInPlace, FollowsProtobufOnMergedAndUnknownFields) {
  RandomBundle b(Spec(2, 3, 4, 20, 8, 5));
  v1::VerifyRequest sent;
  EncodeRequest(b.view(), &sent);
  const std::string base = sent.SerializeAsString();

  v1::VerifyRequest extra;  // a second q with no contents: the first q's bytes stay
  extra.mutable_q()->set_dtype(v1::DTYPE_BF16);
  ExpectSameAsProtobuf(base + extra.SerializeAsString());

  extra.Clear();  // a later q naming a region: the inline bytes are gone
  extra.mutable_q()->mutable_shm()->set_region("r");
  ExpectSameAsProtobuf(base + extra.SerializeAsString());
  // The in-place views point into the wire bytes: those must outlive them.
  std::string wire = base + extra.SerializeAsString();
  v1::VerifyRequest req;
  InPlaceTensors bulk;
  ASSERT_TRUE(ParseRequestInPlace(wire, &req, &bulk));
  EXPECT_FALSE(bulk.q.has_value());
  EXPECT_TRUE(bulk.kv_pool.has_value());

  extra.Clear();  // and inline again after that: the last one wins
  extra.mutable_q()->set_raw_contents("abcd");
  ExpectSameAsProtobuf(base + extra.SerializeAsString());
  wire = base + extra.SerializeAsString();
  ASSERT_TRUE(ParseRequestInPlace(wire, &req, &bulk));
  ASSERT_TRUE(bulk.q.has_value());
  EXPECT_EQ(*bulk.q, "abcd");

  // Unknown fields, at the top and inside a tensor, and field 3 of a tensor as a varint (not
  // raw_contents to protobuf: an unknown field).
  const std::string unknown_top = std::string("\xa8\x06\x05", 3);         // field 101, varint 5
  const std::string tensor_varint3 = std::string("\x12\x02\x18\x07", 4);  // q { 3: 7 }
  const std::string tensor_unknown = std::string("\x1a\x04\xba\x06\x01z", 6);  // kv_pool{103:"z"}
  ExpectSameAsProtobuf(base + unknown_top + tensor_varint3 + tensor_unknown);
}

TEST(RequestInPlace, TruncatedAndCorruptedBytesParseAsProtobufSays) {
  RandomBundle b(Spec(1, 2, 1, 3, 1, 6));
  v1::VerifyRequest sent;
  EncodeRequest(b.view(), &sent);
  sent.set_request_id("x");
  const std::string wire = sent.SerializeAsString();
  for (size_t n = 0; n <= wire.size(); ++n) ExpectSameAsProtobuf(wire.substr(0, n));
  std::mt19937_64 rng(42);
  for (int i = 0; i < 3000; ++i) {
    std::string w = wire;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) w[rng() % w.size()] = static_cast<char>(rng());
    ExpectSameAsProtobuf(w);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "input " << i;
      return;
    }
  }
  ExpectSameAsProtobuf("");                      // the empty message
  ExpectSameAsProtobuf(std::string("\x00", 1));  // tag 0
  // Tags: five bytes are read with the bits past 32 dropped, six bytes are refused.
  ExpectSameAsProtobuf(std::string("\xfa\xff\xff\xff\x12\x00", 6));
  ExpectSameAsProtobuf(std::string("\xfa\xff\xff\xff\x8f\x00\x00", 7));
  ExpectSameAsProtobuf(std::string("\x12\x80", 2));          // a length that never ends
  ExpectSameAsProtobuf(std::string("\x12\x05\x1a\x10", 4));  // raw_contents past its tensor
}

// Lengths and values in more bytes than they need: protobuf's parser takes a size in at most
// five bytes and a varint in at most ten. What the in-place parse rewrites (q's and kv_pool's
// length, raw_contents) must be read under the same rules, and what it copies must stay as sent.
TEST(RequestInPlace, OverlongEncodingsParseAsProtobufSays) {
  const std::string q_tag("\x12", 1), pool_tag("\x1a", 1), raw_tag("\x1a", 1);
  // `len` bytes of payload announced in `n` bytes (padded with continuation bytes).
  auto size = [](uint32_t len, int n) {
    std::string s;
    for (int i = 0; i < n - 1; ++i, len >>= 7) s.push_back(static_cast<char>(0x80 | (len & 0x7f)));
    s.push_back(static_cast<char>(len));
    return s;
  };
  for (int n = 1; n <= 7; ++n) {
    SCOPED_TRACE(n);
    const std::string raw = raw_tag + size(2, n) + "ab";  // a tensor's raw_contents "ab"
    ExpectSameAsProtobuf(q_tag + size(static_cast<uint32_t>(raw.size()), n) + raw);
    ExpectSameAsProtobuf(pool_tag + size(static_cast<uint32_t>(raw.size()), 1) + raw);
    ExpectSameAsProtobuf(std::string("\x0a", 1) + size(1, n) + "x");  // request_id
    const std::string shm = std::string("\x22", 1) + size(0, n);      // an empty shm
    ExpectSameAsProtobuf(q_tag + size(static_cast<uint32_t>(shm.size()), 1) + shm);
    ExpectSameAsProtobuf(std::string("\xa8\x06", 2) + size(5, n));  // field 101, varint
  }
  // The fifth byte of a size above 7 is 2 GiB or more; a varint of eleven bytes never ends.
  ExpectSameAsProtobuf(q_tag + std::string("\x80\x80\x80\x80\x08", 5));
  ExpectSameAsProtobuf(std::string("\xa8\x06", 2) + size(5, 10));
  ExpectSameAsProtobuf(std::string("\xa8\x06", 2) + size(5, 11));
}

std::string Concatenated(const RequestPieces& p) {
  std::string wire;
  for (absl::string_view piece : p.Pieces()) wire.append(piece.data(), piece.size());
  return wire;
}

// A client's side: a request serialized around its bulk (SerializeRequestAround) is, byte for
// byte of what protobuf parses, the request with the bulk copied in; the bulk's pieces are the
// client's own memory, and the daemon's in-place parse finds the bulk again.
TEST(RequestInPlace, ARequestSerializedAroundItsBulkParsesAsTheWholeRequest) {
  for (const RandomBundleSpec& spec : OddSpecs(11)) {
    RandomBundle b(spec);
    v1::VerifyRequest whole, around;
    EncodeRequest(b.view(), &whole);
    InPlaceTensors bulk;
    EncodeRequest(b.view(), &around, &bulk);
    for (v1::VerifyRequest* r : {&whole, &around}) {
      r->set_request_id("call-9");
      r->set_want_lse(true);
    }
    ASSERT_TRUE(bulk.q && bulk.kv_pool);
    EXPECT_TRUE(around.q().raw_contents().empty());
    EXPECT_LT(around.ByteSizeLong(), 4096u + static_cast<size_t>(b.view().shape.num_indices) * 4 +
                                         static_cast<size_t>(b.view().mask_bytes()));

    const RequestPieces pieces = SerializeRequestAround(around, bulk);
    const std::string wire = Concatenated(pieces);
    EXPECT_EQ(pieces.size(), wire.size());
    int borrowed = 0;
    for (absl::string_view piece : pieces.Pieces()) {
      if (piece.data() == static_cast<const void*>(b.view().q) ||
          piece.data() == static_cast<const void*>(b.view().kv_pool)) {
        ++borrowed;
      }
    }
    EXPECT_EQ(borrowed, 2) << "q and the pool are sent from where they are";

    v1::VerifyRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire));
    EXPECT_EQ(parsed.SerializeAsString(), whole.SerializeAsString());
    ExpectSameAsProtobuf(wire);

    v1::VerifyRequest req;
    InPlaceTensors found;
    ASSERT_TRUE(ParseRequestInPlace(wire, &req, &found));
    ASSERT_TRUE(found.q && found.kv_pool);
    EXPECT_EQ(*found.q, *bulk.q);
    EXPECT_EQ(*found.kv_pool, *bulk.kv_pool);
    DecodedRequest d;
    ASSERT_TRUE(DecodeRequest(req, nullptr, Peer(), &d, &found).ok());
    EXPECT_EQ(d.view.shape.num_pages, b.view().shape.num_pages);
  }
}

TEST(RequestInPlace, ARequestSerializedAroundPartOrNoneOfItsBulk) {
  RandomBundle b(Spec(2, 3, 4, 20, 8, 15));
  v1::VerifyRequest whole;
  EncodeRequest(b.view(), &whole);
  // No bulk: one piece, protobuf's own serialization.
  const RequestPieces none = SerializeRequestAround(whole, InPlaceTensors());
  ASSERT_EQ(none.Pieces().size(), 1u);
  EXPECT_EQ(Concatenated(none), whole.SerializeAsString());
  // The pool around, q in the message.
  v1::VerifyRequest part = whole;
  part.mutable_kv_pool()->set_raw_contents("");
  InPlaceTensors bulk;
  bulk.kv_pool = whole.kv_pool().raw_contents();
  v1::VerifyRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Concatenated(SerializeRequestAround(part, bulk))));
  EXPECT_EQ(parsed.SerializeAsString(), whole.SerializeAsString());
  // Bytes left in the message where the bulk is named are overridden; empty bulk is sent empty.
  bulk.q = absl::string_view();
  ASSERT_TRUE(parsed.ParseFromString(Concatenated(SerializeRequestAround(whole, bulk))));
  EXPECT_EQ(parsed.q().contents_case(), v1::Tensor::kRawContents);
  EXPECT_TRUE(parsed.q().raw_contents().empty());
  EXPECT_EQ(parsed.kv_pool().raw_contents(), whole.kv_pool().raw_contents());
}

TEST(RequestInPlace, BulkOfTheWrongSizeIsRefusedNamingTheTensor) {
  RandomBundle b(Spec(1, 2, 2, 9, 4, 7));
  v1::VerifyRequest sent;
  EncodeRequest(b.view(), &sent);
  std::string q = sent.q().raw_contents();
  q.pop_back();
  sent.mutable_q()->set_raw_contents(q);
  const std::string wire = sent.SerializeAsString();
  v1::VerifyRequest req;
  InPlaceTensors bulk;
  ASSERT_TRUE(ParseRequestInPlace(wire, &req, &bulk));
  DecodedRequest d;
  const absl::Status st = DecodeRequest(req, nullptr, Peer(), &d, &bulk);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("q: ", 0), 0u) << st;
}

}  // namespace
}  // namespace verifyd
