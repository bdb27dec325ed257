// The memory budget over real gRPC: a request is admitted only when its bytes fit next to the
// calls in flight; otherwise it is refused at once with RESOURCE_EXHAUSTED naming the limit, and
// counted. A unary call that declares its size (kRequestBytesKey) is judged on it before its
// message is received; verifyctl's calls declare it.

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "nlohmann/json.hpp"
#include "src/bundle/request_in_place.h"
#include "src/common/malloc_arenas.h"
#include "src/common/seconds_since.h"
#include "src/loadgen/pieces_call.h"
#include "src/loadgen/send_command.h"
#include "src/transport/memory_budget.h"
#include "src/transport/request_bytes.h"
#include "tests/common/sanitizers.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;
using testing::kMiB;

constexpr char kVerifyMethod[] = "/verifyd.v1.VerifyService/Verify";

// Waits (at most 10 s) until `done` holds.
template <typename F>
bool WaitFor(F done) {
  for (int i = 0; i < 1000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// One unary Verify call of `body`, as any client could send it, with each of `declared` as a
// value of the request-size key.
grpc::Status DeclaredCall(const std::string& target, const std::vector<std::string>& declared,
                          const std::string& body, v1::VerifyResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  for (const std::string& d : declared) ctx.AddMetadata(kRequestBytesKey, d);
  grpc::Slice slice(body);
  const grpc::ByteBuffer in(&slice, 1);
  grpc::ByteBuffer out;
  auto channel = testing::Channel(target);
  grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(),
      grpc::internal::RpcMethod(kVerifyMethod, grpc::internal::RpcMethod::NORMAL_RPC), &ctx, in,
      &out);
  if (st.ok()) {
    EXPECT_TRUE(grpc::SerializationTraits<v1::VerifyResponse>::Deserialize(&out, resp).ok());
  }
  return st;
}

// A unary Verify call that declares `declared` bytes (nothing when empty) and sends none of
// them: it waits for the message until its status comes or it is cancelled.
class BodilessCall {
 public:
  BodilessCall(const std::string& target, const std::string& declared, double deadline_s)
      : channel_(testing::Channel(target)) {
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
    if (!declared.empty()) ctx_.AddMetadata(kRequestBytesKey, declared);
    stream_.reset(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel_.get(),
            grpc::internal::RpcMethod(kVerifyMethod, grpc::internal::RpcMethod::BIDI_STREAMING),
            &ctx_));
  }
  grpc::Status Finish() { return stream_->Finish(); }
  void Cancel() { ctx_.TryCancel(); }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
};

// A request the CPU engine takes a while over, and its size on the wire.
v1::VerifyRequest SlowRequest() {
  RandomBundleSpec spec;
  spec.batch = 1;
  spec.draft = 8;
  spec.heads = 8;
  spec.prefix = 8192;
  spec.page_size = 64;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

class MemoryBudgetTest : public DaemonTest {};

TEST_F(MemoryBudgetTest, ARequestThatDoesNotFitNextToOneInFlightIsRefusedAtOnce) {
  const v1::VerifyRequest slow = SlowRequest();
  const int64_t slow_bytes = static_cast<int64_t>(slow.ByteSizeLong());
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = slow_bytes + slow_bytes / 2;
  o.inflight_peer_share = 1;  // one client here: the whole budget is its share
  StartDaemon(o);

  // Larger than the whole budget: refused whatever is in flight.
  v1::VerifyRequest huge = slow;
  huge.mutable_kv_pool()->mutable_raw_contents()->append(slow_bytes, '\0');
  v1::VerifyResponse resp;
  grpc::Status st = Verify(huge, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("exceeds the memory budget"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--max_inflight_mb"), std::string::npos);

  auto first = std::async(std::launch::async, [&] {
    v1::VerifyResponse r;
    return Verify(slow, &r);
  });
  // The handler counts a call once the budget admitted it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (daemon_->handler().counters().requests() == 0 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(daemon_->handler().counters().requests(), 1);
  const auto t0 = std::chrono::steady_clock::now();
  st = Verify(slow, &resp);
  const double refused_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("does not fit the memory budget now"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--max_inflight_mb"), std::string::npos);
  EXPECT_EQ(first.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the first call ended before the second was refused; the test proves nothing";
  ASSERT_TRUE(first.get().ok());
  EXPECT_LT(refused_s, 5.0);
  // Once the first call is done its bytes are back.
  st = Verify(slow, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  const std::string metrics = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(metrics.find("verifyd_requests_total{code=\"RESOURCE_EXHAUSTED\",path=\"none\"} 2"),
            std::string::npos);
}

// A comparison that runs after its call's response keeps a copy of the call's inputs (the CPU
// engine detaches them): that copy holds its bytes of the budget until the comparison is done,
// and a comparison whose copy does not fit is shed, not queued beyond the budget. Before, a queue
// of comparisons held copies the budget did not count.
TEST_F(MemoryBudgetTest, AQueuedComparisonsCopyOfTheInputsHoldsItsBytesUntilItRuns) {
  const v1::VerifyRequest slow = SlowRequest();
  const int64_t slow_bytes = static_cast<int64_t>(slow.ByteSizeLong());
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = slow_bytes * 5 / 2;
  o.inflight_peer_share = 1;
  o.shadow_sample_rate = 1;  // every call compared, after its response
  o.shadow_threads = 1;
  StartDaemon(o);
  const MemoryBudget& budget = daemon_->verify_service().budget();
  // The one shadow thread waits here, so the calls' comparisons stay queued.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(daemon_->shadow().TrySubmit([released] { released.wait(); }));

  v1::VerifyResponse resp;
  grpc::Status st = Verify(slow, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  // The call is over; its comparison's copy (q and the pool) still holds about its size.
  const int64_t held = budget.in_flight();
  EXPECT_GT(held, slow_bytes * 9 / 10) << "of " << slow_bytes;
  EXPECT_LE(held, slow_bytes);
  // A second call fits (its message and the first copy), its own copy does not: its comparison
  // is shed and counted as a skip, and the call is served.
  st = Verify(slow, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(budget.in_flight(), held);
  const std::string metrics = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(metrics.find("verifyd_comparisons_total{outcome=\"skipped\"} 1\n"), std::string::npos)
      << metrics.substr(metrics.find("verifyd_comparisons_total"), 400);
  release.set_value();
  daemon_->shadow().WaitIdle();
  EXPECT_TRUE(WaitFor([&] { return budget.in_flight() == 0; }));
}

// The daemon refuses a call whose declared size cannot be admitted without waiting for its
// message: here the message never comes, and the refusal must not wait for it either.
TEST_F(MemoryBudgetTest, ADeclaredSizeOverTheBudgetIsRefusedBeforeTheMessage) {
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = 64 * kMiB;
  o.max_message_bytes = 256 * kMiB;
  o.inflight_peer_share = 1;
  StartDaemon(o);
  std::mt19937_64 rng(41);
  struct Case {
    int64_t declared;
    const char* says;  // the refusal names this limit
  };
  std::vector<Case> cases;
  for (int i = 0; i < 3; ++i) {
    cases.push_back(
        {64 * kMiB + 1 + static_cast<int64_t>(rng() % (192 * kMiB - 1)), "--max_inflight_mb"});
    cases.push_back(
        {256 * kMiB + 1 + static_cast<int64_t>(rng() % (int64_t{1} << 40)), "--max_message_mb"});
  }
  for (const Case& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    BodilessCall call(tcp_, std::to_string(c.declared), 10);
    const grpc::Status st = call.Finish();
    const double took = Since(t0);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << c.declared << ": " << st.error_message() << " after " << took << " s";
    EXPECT_LT(took, 2.0) << "the refusal waited for the message";
    EXPECT_NE(st.error_message().find(kRequestBytesKey), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find(c.says), std::string::npos) << st.error_message();
  }

  // A declaration that fits holds its bytes while the call waits for its message: a second one
  // that does not fit next to it is refused at once, and the bytes come back with the first.
  const MemoryBudget& budget = daemon_->verify_service().budget();
  EXPECT_EQ(budget.in_flight(), 0);
  auto first = std::make_unique<BodilessCall>(tcp_, std::to_string(40 * kMiB), 30);
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 40 * kMiB; }));
  const auto t0 = std::chrono::steady_clock::now();
  BodilessCall second(tcp_, std::to_string(40 * kMiB), 10);
  const grpc::Status st = second.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_LT(Since(t0), 2.0);
  EXPECT_NE(st.error_message().find("does not fit the memory budget now"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(budget.in_flight(), 40 * kMiB);
  first->Cancel();
  first->Finish();
  first.reset();
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 0; }));
  const v1::VerifyRequest req = testing::SmallRequest(41);
  v1::VerifyResponse resp;
  const grpc::Status ok =
      DeclaredCall(tcp_, {std::to_string(40 * kMiB)}, req.SerializeAsString(), &resp);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_requests_total{code=\"RESOURCE_EXHAUSTED\",path=\"none\"} " +
                   std::to_string(cases.size() + 1)),
            std::string::npos)
      << m;
}

// A declared size whose message never comes holds its bytes only until the body timeout, whatever
// the client's own deadline: then the call is cancelled, counted, and the bytes are back.
TEST_F(MemoryBudgetTest, ADeclaredSizeThatNeverArrivesIsReleasedAtTheBodyTimeout) {
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = 64 * kMiB;
  o.inflight_peer_share = 1;
  o.streams.body_timeout = absl::Milliseconds(600);
  StartDaemon(o);
  const MemoryBudget& budget = daemon_->verify_service().budget();
  const auto t0 = std::chrono::steady_clock::now();
  BodilessCall holder(tcp_, std::to_string(60 * kMiB), /*deadline_s=*/120);
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 60 * kMiB; }));
  const v1::VerifyRequest req = testing::SmallRequest(47);
  v1::VerifyResponse resp;
  grpc::Status st = DeclaredCall(tcp_, {std::to_string(8 * kMiB)}, req.SerializeAsString(), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  st = holder.Finish();
  const double held_s = Since(t0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_GE(held_s, 0.5);
  EXPECT_LT(held_s, 5.0) << "the body timeout did not end the call";
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 0; }));
  st = DeclaredCall(tcp_, {std::to_string(8 * kMiB)}, req.SerializeAsString(), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_tenancy_refusals_total{reason=\"body_timeout\",resource=\"call\"} 1"),
            std::string::npos)
      << m;
}

// No one peer holds more than --max_inflight_peer_share of the budget: the TCP host is one peer,
// the Unix socket's uid another.
TEST_F(MemoryBudgetTest, OnePeerHoldsNoMoreThanItsShareOfTheBudget) {
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = 64 * kMiB;
  o.inflight_peer_share = 0.5;
  StartDaemon(o);
  const MemoryBudget& budget = daemon_->verify_service().budget();
  EXPECT_EQ(budget.peer_limit(), 32 * kMiB);
  auto first = std::make_unique<BodilessCall>(tcp_, std::to_string(24 * kMiB), 30);
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 24 * kMiB; }));
  BodilessCall second(tcp_, std::to_string(24 * kMiB), 10);
  grpc::Status st = second.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("--max_inflight_peer_share"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("ipv4:127.0.0.1"), std::string::npos) << st.error_message();
  // Another peer fits beside it.
  const v1::VerifyRequest req = testing::SmallRequest(48);
  v1::VerifyResponse resp;
  st = DeclaredCall(daemon_->listen_addresses()[1], {std::to_string(24 * kMiB)},
                    req.SerializeAsString(), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  first->Cancel();
  first->Finish();
  first.reset();
  ASSERT_TRUE(WaitFor([&] { return budget.in_flight() == 0; }));
  st = DeclaredCall(tcp_, {std::to_string(24 * kMiB)}, req.SerializeAsString(), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_tenancy_refusals_total{reason=\"peer_share\",resource=\"budget\"} 1"),
            std::string::npos)
      << m;
}

// Calls that send headers and nothing else hold a thread each until their message comes: one
// peer gets --grpc_max_waiting_calls_per_peer of them, is refused past that at once, and loses
// them at the body timeout. Another peer is served throughout; then the first is again.
TEST_F(MemoryBudgetTest, HeaderOnlyCallsTakeAPeersShareOfThreadsAndEndAtTheBodyTimeout) {
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.streams.max_waiting_calls_per_peer = 4;
  o.streams.body_timeout = absl::Seconds(2);
  StartDaemon(o);
  std::vector<std::unique_ptr<BodilessCall>> calls;
  for (int i = 0; i < 140; ++i) calls.push_back(std::make_unique<BodilessCall>(tcp_, "", 60));
  const v1::VerifyRequest req = testing::SmallRequest(49);
  auto unix_stub = v1::VerifyService::NewStub(testing::Channel(daemon_->listen_addresses()[1]));
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::VerifyResponse resp;
    const grpc::Status st = unix_stub->Verify(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << "call " << i << " from another peer: " << st.error_message();
  }
  int refused = 0, cancelled = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& c : calls) {
    const grpc::Status st = c->Finish();
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        st.error_message().find("--grpc_max_waiting_calls_per_peer=4") != std::string::npos) {
      ++refused;
    } else if (st.error_code() == grpc::StatusCode::CANCELLED) {
      ++cancelled;
    } else {
      ADD_FAILURE() << st.error_code() << ": " << st.error_message();
    }
  }
  EXPECT_EQ(refused, 136);
  EXPECT_EQ(cancelled, 4);
  EXPECT_LT(Since(t0), 10.0);
  v1::VerifyResponse resp;
  EXPECT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(daemon_->verify_service().streams().body_cancelled(), 4);
}

TEST_F(MemoryBudgetTest, AMessageLargerThanDeclaredIsRefusedNamingTheKey) {
  StartDaemon(testing::TestOptions(testing::TestDir("budget")));
  std::mt19937_64 rng(43);
  for (int i = 0; i < 4; ++i) {
    const v1::VerifyRequest req = testing::SmallRequest(430 + i, 1 + static_cast<int>(rng() % 8),
                                                        static_cast<int64_t>(rng() % 3000));
    const std::string body = req.SerializeAsString();
    const int64_t size = static_cast<int64_t>(body.size());
    const int64_t short_by = 1 + static_cast<int64_t>(rng() % (size - 1));
    v1::VerifyResponse resp;
    grpc::Status st = DeclaredCall(tcp_, {std::to_string(size - short_by)}, body, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "declared " << size - short_by << " of " << size;
    EXPECT_EQ(st.error_message().rfind(kRequestBytesKey, 0), 0u) << st.error_message();
    // Declared exactly, or more than it is: served.
    st = DeclaredCall(tcp_, {std::to_string(size)}, body, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    st = DeclaredCall(tcp_, {std::to_string(size + static_cast<int64_t>(rng() % (64 * kMiB)))},
                      body, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(resp.o().raw_contents().size(),
              static_cast<size_t>(req.q().raw_contents().size()) / 576 * 512)
        << "call " << i;
    // The admission was the message's size, and it is given back.
    EXPECT_TRUE(WaitFor([this] { return daemon_->verify_service().budget().in_flight() == 0; }));
  }
}

TEST_F(MemoryBudgetTest, AMalformedDeclarationIsRefusedNamingTheKeyAndTheDaemonGoesOn) {
  StartDaemon(testing::TestOptions(testing::TestDir("budget")));
  const v1::VerifyRequest req = testing::SmallRequest(45);
  const std::string body = req.SerializeAsString();
  const std::string size = std::to_string(body.size());
  std::mt19937_64 rng(45);
  std::vector<std::vector<std::string>> bad = {{""},           {"-" + size},
                                               {"+" + size},   {size + " "},
                                               {size + ".0"},  {"0x10"},
                                               {"1e9"},        {"abc"},
                                               {size, size},   {"99999999999999999999"},
                                               {size + "abc"}, {"18446744073709551616"}};
  for (int i = 0; i < 4; ++i) {  // random printable junk
    std::string junk;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int k = 0; k < n; ++k) junk += static_cast<char>('!' + rng() % 94);
    if (junk.find_first_not_of("0123456789") == std::string::npos) junk += "x";
    bad.push_back({junk});
  }
  for (const auto& values : bad) {
    const std::string shown = values.size() == 1 ? values[0] : values[0] + "' twice '";
    v1::VerifyResponse resp;
    const grpc::Status st = DeclaredCall(tcp_, values, body, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << "'" << shown << "': " << st.error_message();
    EXPECT_EQ(st.error_message().rfind(kRequestBytesKey, 0), 0u)
        << "'" << shown << "': " << st.error_message();
    // The daemon goes on: the same message, declared right, and undeclared.
    EXPECT_TRUE(DeclaredCall(tcp_, {size}, body, &resp).ok()) << "after '" << shown << "'";
    EXPECT_TRUE(DeclaredCall(tcp_, {}, body, &resp).ok()) << "after '" << shown << "'";
  }
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_requests_total{code=\"INVALID_ARGUMENT\",path=\"none\"} " +
                   std::to_string(bad.size())),
            std::string::npos)
      << m;
}

// verifyctl's unary calls (q and the pool sent as pieces, or the whole message) declare their
// size: an over-budget one is refused from its declaration, which the refusal names.
TEST_F(MemoryBudgetTest, VerifyctlsCallsDeclareTheirSize) {
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = 4 * kMiB;
  StartDaemon(o);
  cli::PiecesCaller caller(testing::Channel(tcp_));
  std::mt19937 rng(47);
  for (int i = 0; i < 3; ++i) {
    // A few MB of pool: over the budget.
    v1::VerifyRequest req = testing::SmallRequest(470 + i, 1 + static_cast<int>(rng() % 8),
                                                  5000 + static_cast<int64_t>(rng() % 3000), 64);
    const std::string q = req.q().raw_contents(), pool = req.kv_pool().raw_contents();
    req.mutable_q()->set_raw_contents("");
    req.mutable_kv_pool()->set_raw_contents("");
    InPlaceTensors bulk;
    bulk.q = q;
    bulk.kv_pool = pool;
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    grpc::Status st = caller.Verify(&ctx, SerializeRequestAround(req, bulk), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_EQ(st.error_message().rfind(kRequestBytesKey, 0), 0u) << st.error_message();
    // One that fits is served.
    v1::VerifyRequest small = testing::SmallRequest(480 + i);
    const std::string sq = small.q().raw_contents(), spool = small.kv_pool().raw_contents();
    small.mutable_q()->set_raw_contents("");
    small.mutable_kv_pool()->set_raw_contents("");
    bulk.q = sq;
    bulk.kv_pool = spool;
    grpc::ClientContext ok_ctx;
    st = caller.Verify(&ok_ctx, SerializeRequestAround(small, bulk), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  // verifyctl send, both encodings.
  for (const char* encode : {"pieces", "message"}) {
    cli::GlobalOptions g;
    g.target = tcp_;
    g.json = true;
    cli::SendOptions s;
    s.shape = "1,4,8,8000";
    s.count = 2;
    s.inline_encode = encode;
    ::testing::internal::CaptureStdout();
    const int rc = cli::RunSend(g, s);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, 1) << out;
    const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << out;
    const std::string first = j.value("first_error", "");
    EXPECT_EQ(first.rfind(std::string("RESOURCE_EXHAUSTED: ") + kRequestBytesKey, 0), 0u)
        << encode << ": " << out;
  }
}

// This process's resident bytes.
int64_t Resident() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  long size = 0, resident = 0;
  const bool ok = f != nullptr && std::fscanf(f, "%ld %ld", &size, &resident) == 2;
  if (f != nullptr) std::fclose(f);
  return ok ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : -1;
}

// A request of about `bytes` that is cheap to serve: a small bundle in a pool of unused pages.
v1::VerifyRequest LargeCheapRequest(int64_t bytes, uint64_t seed) {
  RandomBundleSpec spec;
  spec.batch = 1;
  spec.draft = 2;
  spec.heads = 8;
  spec.prefix = 128;
  spec.page_size = 64;
  spec.extra_pages = static_cast<int>(bytes / (64 * 576 * 2));
  spec.seed = seed;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

// After a burst of large calls, the memory the heap holds freed goes back to the system. Freed
// memory below a block still in use stays resident with glibc (free() gives back only the top of
// the heap): the test frees such a block itself, as a burst's calls leave them, then sends the
// burst.
TEST_F(MemoryBudgetTest, FreedHeapMemoryGoesBackToTheSystemAfterABurst) {
#if VERIFYD_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer replaces malloc";
#endif
  if (std::getenv("MALLOC_MMAP_MAX_") || std::getenv("MALLOC_TRIM_THRESHOLD_") ||
      std::getenv("GLIBC_TUNABLES")) {
    GTEST_SKIP() << "malloc is tuned by the environment";
  }
  constexpr int64_t kKeep = 32 * kMiB;  // the trimmer's threshold is then 64 MiB
  KeepFreedMemory(kKeep);               // as verifyd's main() does with --keep_freed_mb=32
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.keep_freed_bytes = kKeep;
  o.pinned_receive_bytes = 0;  // no receive buffer is kept (resident) for later calls
  StartDaemon(o);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(testing::SmallRequest(49), &resp).ok());  // warm

  const int64_t before = Resident();
  constexpr size_t kHeld = size_t{256} << 20;
  char* held = static_cast<char*>(std::malloc(kHeld));
  ASSERT_NE(held, nullptr);
  std::memset(held, 1, kHeld);
  // Blocks above it, from the top of the heap, that stay in use.
  std::vector<void*> above;
  while (above.empty() || static_cast<char*>(above.back()) < held) {
    ASSERT_LT(above.size(), 256u) << "no block above the held one";
    above.push_back(std::malloc(size_t{2} << 20));
  }
  std::free(held);
  const int64_t freed = Resident();
  ASSERT_GT(freed, before + static_cast<int64_t>(kHeld) * 3 / 4)
      << "glibc gave the block back by itself; the test proves nothing";

  // The burst: two calls of more than the threshold each, at once.
  std::mt19937 rng(49);
  std::vector<std::future<grpc::Status>> calls;
  for (int i = 0; i < 2; ++i) {
    const int64_t bytes = 72 * kMiB + static_cast<int64_t>(rng() % (8 * kMiB));
    calls.push_back(std::async(std::launch::async, [this, bytes, i] {
      const v1::VerifyRequest big = LargeCheapRequest(bytes, 490 + i);
      EXPECT_GT(static_cast<int64_t>(big.ByteSizeLong()), 64 * kMiB);
      v1::VerifyResponse r;
      return Verify(big, &r);
    }));
  }
  for (auto& c : calls) {
    const grpc::Status st = c.get();
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  // The trim comes a second after the burst; if the two calls did not overlap, the second one's
  // comes 10 s after the first's.
  // Most of the 256 MiB block held freed comes back (without the trimmer, none of it does).
  int64_t after = Resident();
  const auto t0 = std::chrono::steady_clock::now();
  while (after > freed - 128 * kMiB && Since(t0) < 15) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    after = Resident();
  }
  EXPECT_LT(after, freed - 128 * kMiB) << "resident MiB: " << (before >> 20) << " before, "
                                       << (freed >> 20) << " with the freed block held, "
                                       << (after >> 20) << " " << Since(t0) << " s after the burst";
  // The trimmer gave it back (it counts the trim once malloc_trim has returned).
  EXPECT_TRUE(WaitFor([this] { return daemon_->verify_service().trimmer().trims() >= 1; }));
  std::cout << "resident MiB: " << (before >> 20) << " before, " << (freed >> 20)
            << " with the freed block held, " << (after >> 20) << " " << Since(t0)
            << " s after the burst\n";
  for (void* p : above) std::free(p);
  mallopt(M_MMAP_MAX, 65536);  // glibc's defaults again, for any test after this one
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
}

}  // namespace
}  // namespace verifyd
