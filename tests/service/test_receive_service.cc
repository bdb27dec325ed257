// Over real gRPC, request messages received into pooled buffers and parsed in place: calls of
// odd sizes served bit for bit on the unary call and the stream, and sent by a client as pieces
// (q and the pool from the client's own memory).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/bundle/request_in_place.h"
#include "src/loadgen/pieces_call.h"
#include "src/transport/receive_buffers.h"
#include "tests/service/daemon_fixture.h"
#include "tests/transport/sliced_message.h"

namespace verifyd {
namespace {

using testing::kMiB;
using testing::Sliced;

using testing::LocalOutput;

using testing::MetricValue;

class ReceiveService : public testing::DaemonTest {};

TEST_F(ReceiveService, InlineCallsOfOddSizesAreServedBitForBitOnTheCallAndTheStream) {
  StartDaemon(testing::TestOptions(testing::TestDir("recv")));
  std::mt19937 rng(23);
  grpc::ClientContext sctx;
  auto stream = verify_->VerifyStream(&sctx);
  for (int i = 0; i < 6; ++i) {
    // Prefixes up to a few thousand keys: messages of a few KB to several MB, many slices.
    const int draft = 1 + static_cast<int>(rng() % 9);
    const int64_t prefix = static_cast<int64_t>(rng() % 6000);
    const int page = 1 << (rng() % 7);
    const v1::VerifyRequest req = testing::SmallRequest(100 + i, draft, prefix, page);
    const std::string want = LocalOutput(req, Path::kReference);
    v1::VerifyResponse unary;
    ASSERT_TRUE(Verify(req, &unary).ok()) << "call " << i;
    EXPECT_EQ(unary.o().raw_contents(), want) << "unary call " << i;
    v1::VerifyResponse streamed;
    ASSERT_TRUE(stream->Write(req));
    ASSERT_TRUE(stream->Read(&streamed));
    EXPECT_TRUE(streamed.error_message().empty()) << streamed.error_message();
    EXPECT_EQ(streamed.o().raw_contents(), want) << "streamed call " << i;
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  // The calls went through kept receive buffers; the CUDA engine pins them.
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_GE(MetricValue(m, "verifyd_receive_buffer_bytes"), double(kMiB)) << m;
  const double pinned = MetricValue(m, "verifyd_receive_buffer_pinned_bytes");
  if (testing::TestEngine() == "cuda") {
    EXPECT_GE(pinned, double(kMiB));
  } else {
    EXPECT_EQ(pinned, 0);
  }
}

// verifyctl's inline calls: q and the pool are not in the message but sent from where they lie.
TEST_F(ReceiveService, ARequestSentAsPiecesIsServedAsTheWholeMessage) {
  StartDaemon(testing::TestOptions(testing::TestDir("recv")));
  cli::PiecesCaller caller(testing::Channel(tcp_));
  std::mt19937 rng(31);
  for (int i = 0; i < 3; ++i) {
    const int draft = 1 + static_cast<int>(rng() % 9);
    const int64_t prefix = static_cast<int64_t>(rng() % 3000);
    const int page = 1 << (rng() % 7);
    v1::VerifyRequest req = testing::SmallRequest(200 + i, draft, prefix, page);
    req.set_request_id("pieces-" + std::to_string(i));
    const std::string want = LocalOutput(req, Path::kReference);
    // The client's memory: q and the pool outside the message.
    const std::string q = req.q().raw_contents(), pool = req.kv_pool().raw_contents();
    req.mutable_q()->set_raw_contents("");
    req.mutable_kv_pool()->set_raw_contents("");
    InPlaceTensors bulk;
    bulk.q = q;
    bulk.kv_pool = pool;
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    const grpc::Status st = caller.Verify(&ctx, SerializeRequestAround(req, bulk), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(resp.error_message().empty()) << resp.error_message();
    EXPECT_EQ(resp.request_id(), req.request_id());
    EXPECT_EQ(resp.o().raw_contents(), want) << "call " << i;

    // A pool one byte short is refused naming it, and the caller goes on.
    bulk.kv_pool = absl::string_view(pool).substr(1);
    grpc::ClientContext bad_ctx;
    const grpc::Status bad = caller.Verify(&bad_ctx, SerializeRequestAround(req, bulk), &resp);
    EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(bad.error_message().rfind("kv_pool", 0), 0u) << bad.error_message();
  }
}

TEST_F(ReceiveService, ABadMessageIsRefusedAndTheNextCallIsServed) {
  StartDaemon(testing::TestOptions(testing::TestDir("recv")));
  // A field 1 with a length past the message's end, in two slices.
  std::string bad = "\x0a\xff\xff\x03";
  bad += std::string(1000, 'x');
  std::mt19937 rng(29);
  grpc::ByteBuffer req = Sliced(bad, 2, rng), resp;
  const grpc::Status st =
      testing::RawUnaryCall(tcp_, "/verifyd.v1.VerifyService/Verify", &req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("could not be parsed"), std::string::npos)
      << st.error_message();
  const v1::VerifyRequest good = testing::SmallRequest(5);
  v1::VerifyResponse r;
  ASSERT_TRUE(Verify(good, &r).ok());
  EXPECT_EQ(r.o().raw_contents(), LocalOutput(good, Path::kReference));
}

}  // namespace
}  // namespace verifyd
