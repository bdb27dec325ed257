// Every validation rule, over real gRPC: INVALID_ARGUMENT (or PERMISSION_DENIED) with a message
// that names the field; afterwards the same daemon still serves a good bundle.

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;

int32_t GetI32(const v1::Tensor& t, int i) {
  int32_t v;
  std::memcpy(&v, t.raw_contents().data() + 4 * i, 4);
  return v;
}
void SetI32(v1::Tensor* t, int i, int32_t v) {
  std::memcpy(t->mutable_raw_contents()->data() + 4 * i, &v, 4);
}

struct BadCase {
  const char* name;
  std::function<void(v1::VerifyRequest*)> mutate;
  const char* field;  // the message must contain this
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
};

class ValidationTest : public DaemonTest {
 protected:
  // Bytes on the wire as they are, whether they parse or not.
  static grpc::ByteBuffer Bytes(const std::string& s) {
    grpc::Slice slice(s);
    return grpc::ByteBuffer(&slice, 1);
  }
  static grpc::ByteBuffer Bytes(const v1::VerifyRequest& r) { return Bytes(r.SerializeAsString()); }
  static v1::VerifyResponse Parsed(grpc::ByteBuffer& b) {
    v1::VerifyResponse resp;
    EXPECT_TRUE(grpc::SerializationTraits<v1::VerifyResponse>::Deserialize(&b, &resp).ok());
    return resp;
  }
  grpc::Status RawVerify(const grpc::ByteBuffer& in, v1::VerifyResponse* resp) {
    grpc::ClientContext ctx;
    grpc::ByteBuffer out;
    grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(),
        grpc::internal::RpcMethod("/verifyd.v1.VerifyService/Verify",
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &ctx, in, &out);
    if (st.ok()) *resp = Parsed(out);
    return st;
  }
  // Sends every message on one stream, then reads until the server ends it.
  grpc::Status RawStream(const std::vector<grpc::ByteBuffer>& msgs,
                         std::vector<v1::VerifyResponse>* resps) {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel_.get(),
            grpc::internal::RpcMethod("/verifyd.v1.VerifyService/VerifyStream",
                                      grpc::internal::RpcMethod::BIDI_STREAMING),
            &ctx));
    for (const grpc::ByteBuffer& m : msgs) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    grpc::ByteBuffer out;
    while (stream->Read(&out)) resps->push_back(Parsed(out));
    return stream->Finish();
  }
  void Start(int64_t max_message_bytes = int64_t{2} << 30) {
    DaemonOptions o = testing::TestOptions(testing::TestDir("validation"));
    o.max_message_bytes = max_message_bytes;
    StartDaemon(o);
    channel_ = testing::Channel(tcp_);
  }
  std::shared_ptr<grpc::Channel> channel_;
};

// The sample count of a verifyd_requests_total series, or -1 when there is none.
double RequestsTotal(const std::string& metrics, const std::string& labels) {
  const std::string key = "verifyd_requests_total{" + labels + "} ";
  const size_t at = metrics.find(key);
  return at == std::string::npos ? -1 : std::stod(metrics.substr(at + key.size()));
}

// q: absent, of the wrong type or shape, or where TCP clients may not name it.
std::vector<BadCase> QBadCases() {
  return {
      {"q missing", [](auto* r) { r->clear_q(); }, "q: missing"},
      {"q dtype", [](auto* r) { r->mutable_q()->set_dtype(v1::DTYPE_F32); }, "q: dtype"},
      {"q rank", [](auto* r) { r->mutable_q()->mutable_shape()->RemoveLast(); }, "q: shape"},
      {"q bytes", [](auto* r) { r->mutable_q()->mutable_raw_contents()->resize(10); },
       "q: 10 bytes"},
      {"q rows",
       [](auto* r) {
         auto* q = r->mutable_q();
         q->set_shape(0, 5);
         q->set_shape(1, 8 * 6 / 5 + 1);  // keeps nothing consistent
       },
       "q: "},
      {"q head dim",
       [](auto* r) {
         auto* q = r->mutable_q();
         q->set_shape(1, 9);
         q->set_shape(2, 512);
       },
       "q: shape"},
      {"q heads zero",
       [](auto* r) {
         auto* q = r->mutable_q();
         q->set_shape(1, 0);
         q->clear_raw_contents();
         q->set_raw_contents("");
       },
       "q: heads"},
      {"q heads 129",
       [](auto* r) {
         auto* q = r->mutable_q();
         q->set_shape(1, 129);
         q->set_raw_contents(std::string(6 * 129 * 576 * 2, '\0'));
       },
       "q: heads"},
      {"q byte count overflows",
       [](auto* r) {
         auto* q = r->mutable_q();
         q->set_shape(0, int64_t{1} << 40);
         q->set_shape(1, int64_t{1} << 40);
       },
       "q: shape [1099511627776, 1099511627776, 576] has more than 2^63 bytes"},
      // Regions are refused over TCP before the handler sees the call
      // (tests/service/test_regions.cc has the bad references over a Unix socket).
      {"q in shared memory over TCP",
       [](auto* r) { r->mutable_q()->mutable_shm()->set_region("r0"); },
       "q: shared-memory and CUDA IPC regions are served on Unix sockets only",
       grpc::StatusCode::PERMISSION_DENIED},
  };
}

// The KV pool: its type, head dim and page size.
std::vector<BadCase> PoolBadCases() {
  return {
      {"kv_pool dtype", [](auto* r) { r->mutable_kv_pool()->set_dtype(v1::DTYPE_U8); },
       "kv_pool: dtype"},
      {"kv_pool head dim",
       [](auto* r) {
         auto* p = r->mutable_kv_pool();
         p->set_shape(1, p->shape(1) * 576 / 512);
         p->set_shape(2, 512);
       },
       "kv_pool: shape"},
      {"page_size 3",
       [](auto* r) {
         auto* p = r->mutable_kv_pool();
         p->set_shape(0, p->shape(0) * 16);
         p->set_shape(1, 1);
         p->set_shape(0, p->shape(0) / 3);
         p->set_shape(1, 3);
         p->mutable_raw_contents()->resize(p->shape(0) * 3 * 576 * 2);
       },
       "page_size: 3"},
      {"page_size 256",
       [](auto* r) {
         auto* p = r->mutable_kv_pool();
         const int64_t pages = p->shape(0) / 16;
         p->set_shape(0, pages);
         p->set_shape(1, 256);
         p->mutable_raw_contents()->resize(pages * 256 * 576 * 2);
       },
       "page_size 256"},
  };
}

// The page table and the requests' lengths; `pool_pages` is the pool's page count.
std::vector<BadCase> PageTableBadCases(int pool_pages) {
  return {
      {"kv_indptr length",
       [](auto* r) {
         r->mutable_kv_indptr()->set_shape(0, 2);
         r->mutable_kv_indptr()->mutable_raw_contents()->resize(8);
       },
       "kv_indptr: shape"},
      {"kv_indptr[0]", [](auto* r) { SetI32(r->mutable_kv_indptr(), 0, 1); }, "kv_indptr[0]"},
      {"kv_indptr decreasing",
       [](auto* r) { SetI32(r->mutable_kv_indptr(), 1, GetI32(r->kv_indptr(), 2) + 1); },
       "kv_indptr[2]"},
      {"kv_indptr end",
       [](auto* r) { SetI32(r->mutable_kv_indptr(), 2, GetI32(r->kv_indptr(), 2) - 1); },
       "kv_indptr[2]"},
      {"kv_indices dtype", [](auto* r) { r->mutable_kv_indices()->set_dtype(v1::DTYPE_F32); },
       "kv_indices: dtype"},
      {"kv_indices past pool",
       [pool_pages](auto* r) { SetI32(r->mutable_kv_indices(), 5, pool_pages); }, "kv_indices[5]"},
      {"kv_indices negative", [](auto* r) { SetI32(r->mutable_kv_indices(), 0, -1); },
       "kv_indices[0]"},
      {"kv_lens dtype", [](auto* r) { r->mutable_kv_lens()->set_dtype(v1::DTYPE_BF16); },
       "kv_lens: dtype"},
      {"kv_lens below T", [](auto* r) { SetI32(r->mutable_kv_lens(), 1, 2); }, "kv_lens[1]"},
      {"kv_lens needs more pages", [](auto* r) { SetI32(r->mutable_kv_lens(), 0, 65); },
       "kv_indptr: request 0"},
      {"prefix over limit", [](auto* r) { SetI32(r->mutable_kv_lens(), 0, 131072 + 4); },
       "kv_lens[0]: prefix"},
      {"batch zero",
       [](auto* r) {
         r->mutable_kv_lens()->set_shape(0, 0);
         r->mutable_kv_lens()->set_raw_contents("");
       },
       "kv_lens: batch 0"},
  };
}

// The tree mask and the softmax scale.
std::vector<BadCase> MaskAndScaleBadCases() {
  return {
      {"tree_mask value",
       [](auto* r) { (*r->mutable_tree_mask()->mutable_raw_contents())[1 * 3 + 2] = 2; },
       "tree_mask[0,1,2]"},
      {"tree_mask batch",
       [](auto* r) {
         auto* m = r->mutable_tree_mask();
         m->set_shape(0, 1);
         m->mutable_raw_contents()->resize(9);
       },
       "tree_mask: shape"},
      {"tree_mask T over limit",
       [](auto* r) {
         auto* m = r->mutable_tree_mask();
         m->set_shape(1, 1025);
         m->set_shape(2, 1025);
         m->mutable_raw_contents()->resize(2 * 1025 * 1025);
       },
       "tree_mask: draft length T = 1025"},
      {"tree_mask bits padding",
       [](auto* r) {
         r->set_mask_format(v1::MASK_FORMAT_BITS);
         auto* m = r->mutable_tree_mask();
         m->set_shape(2, 1);
         std::string bits(6, '\x01');
         bits[4] = '\xff';  // bits 3..7 are past T = 3
         m->set_raw_contents(bits);
       },
       "tree_mask[1,1]"},
      {"mask_format unknown", [](auto* r) { r->set_mask_format(static_cast<v1::MaskFormat>(7)); },
       "mask_format"},
      {"sm_scale zero", [](auto* r) { r->set_sm_scale(0); }, "sm_scale"},
      {"sm_scale negative", [](auto* r) { r->set_sm_scale(-0.1f); }, "sm_scale"},
      {"sm_scale NaN", [](auto* r) { r->set_sm_scale(std::nanf("")); }, "sm_scale"},
      {"sm_scale inf", [](auto* r) { r->set_sm_scale(std::numeric_limits<float>::infinity()); },
       "sm_scale"},
  };
}

// Every bad bundle, each a mutation of a good one whose pool holds `pool_pages` pages.
std::vector<BadCase> BadCases(int pool_pages) {
  std::vector<BadCase> cases;
  for (const std::vector<BadCase>& part :
       {QBadCases(), PoolBadCases(), PageTableBadCases(pool_pages), MaskAndScaleBadCases()}) {
    cases.insert(cases.end(), part.begin(), part.end());
  }
  return cases;
}

TEST_F(ValidationTest, EveryBadBundleIsRejectedByFieldAndTheDaemonKeepsServing) {
  StartDaemon(testing::TestOptions(testing::TestDir("validation")));
  // B=2, T=3, H=8, page 16, prefix 54: kv_len 57 = 4 pages per request.
  const v1::VerifyRequest good = testing::SmallRequest(7);
  const int pool_pages = static_cast<int>(good.kv_pool().shape(0));
  const std::vector<BadCase> cases = BadCases(pool_pages);
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::VerifyRequest req = good;
    c.mutate(&req);
    v1::VerifyResponse resp;
    grpc::Status st = Verify(req, &resp);
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_NE(st.error_message().find(c.field), std::string::npos)
        << "message '" << st.error_message() << "' does not name '" << c.field << "'";
  }
  v1::VerifyResponse resp;
  grpc::Status st = Verify(good, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.o().shape(0), 6);
  EXPECT_EQ(static_cast<int64_t>(resp.o().raw_contents().size()), 6 * 8 * 512 * 2);
  int64_t reached_handler = 0;
  for (const BadCase& c : cases) reached_handler += c.code != grpc::StatusCode::PERMISSION_DENIED;
  EXPECT_EQ(daemon_->handler().counters().request_errors(), reached_handler);
  EXPECT_NE(testing::Scrape(daemon_->metrics_port())
                .find("verifyd_requests_total{code=\"INVALID_ARGUMENT\",path=\"none\"}"),
            std::string::npos);
}

TEST_F(ValidationTest, ABadMessageOnTheStreamGetsAnInBandErrorAndTheStreamGoesOn) {
  StartDaemon(testing::TestOptions(testing::TestDir("validation")));
  grpc::ClientContext ctx;
  auto stream = verify_->VerifyStream(&ctx);
  v1::VerifyRequest good = testing::SmallRequest(3);
  v1::VerifyRequest bad = good;
  bad.set_sm_scale(-1);
  bad.set_request_id("bad");
  for (const auto* r : {&good, &bad, &good}) {
    ASSERT_TRUE(stream->Write(*r));
    v1::VerifyResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    if (r == &bad) {
      EXPECT_EQ(resp.error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      EXPECT_NE(resp.error_message().find("sm_scale"), std::string::npos);
      EXPECT_EQ(resp.request_id(), "bad");
    } else {
      EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
      EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
    }
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ValidationTest, UnparseableStreamMessageGetsAnInBandError) {
  Start();
  v1::VerifyRequest good = testing::SmallRequest(3);
  good.set_request_id("good");
  std::vector<v1::VerifyResponse> resps;
  grpc::Status st = RawStream(
      {Bytes(good), Bytes(std::string("\xff\xff\xff\xff")), Bytes(good), Bytes(good)}, &resps);
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resps.size(), 4u);
  for (int i : {0, 2, 3}) {
    EXPECT_EQ(resps[i].error_code(), 0) << resps[i].error_message();
    EXPECT_EQ(resps[i].request_id(), "good");
    EXPECT_EQ(resps[i].o().shape(0), 6);
  }
  EXPECT_EQ(resps[1].error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(resps[1].error_message().find("message could not be parsed"), std::string::npos)
      << resps[1].error_message();
  EXPECT_EQ(RequestsTotal(testing::Scrape(daemon_->metrics_port()),
                          "code=\"INVALID_ARGUMENT\",path=\"none\""),
            1);
}

TEST_F(ValidationTest, UnparseableUnaryMessageIsInvalidArgument) {
  Start();
  v1::VerifyResponse resp;
  grpc::Status st = RawVerify(Bytes(std::string("\xff\xff\xff\xff")), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("message could not be parsed"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(RequestsTotal(testing::Scrape(daemon_->metrics_port()),
                          "code=\"INVALID_ARGUMENT\",path=\"none\""),
            1);
  // The same bytes through the raw client parse and serve when they are a request.
  st = RawVerify(Bytes(testing::SmallRequest(4)), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.o().shape(0), 6);
}

TEST_F(ValidationTest, OverLimitMessageIsResourceExhausted) {
  Start(int64_t{1} << 20);
  const grpc::ByteBuffer big = Bytes(std::string((1 << 20) + 1, '\0'));
  v1::VerifyResponse resp;
  grpc::Status st = RawVerify(big, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("1 MiB (--max_message_mb)"), std::string::npos)
      << st.error_message();
  // On a stream the refusal is in band and the stream goes on.
  std::vector<v1::VerifyResponse> resps;
  st = RawStream({big, Bytes(testing::SmallRequest(5))}, &resps);
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resps.size(), 2u);
  EXPECT_EQ(resps[0].error_code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_NE(resps[0].error_message().find("1048577 bytes"), std::string::npos);
  EXPECT_EQ(resps[1].error_code(), 0) << resps[1].error_message();
  EXPECT_EQ(RequestsTotal(testing::Scrape(daemon_->metrics_port()),
                          "code=\"RESOURCE_EXHAUSTED\",path=\"none\""),
            2);
  // A request that fits is still served by the unary call.
  ASSERT_TRUE(Verify(testing::SmallRequest(6), &resp).ok());
}

}  // namespace
}  // namespace verifyd
