// The daemon end to end over real gRPC (TCP port 0 and a Unix socket) on the CPU engine:
// responses equal the served path's output bit for bit, /metrics counts comparisons, flips change
// what is served, a failing custom path is isolated, health and admin auth.

#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;

using testing::LocalOutput;

using testing::MetricValue;

// grpc.health.v1.Health/Check for the whole server; returns the serialized HealthCheckResponse
// ("\x08\x01" = SERVING, "\x08\x02" = NOT_SERVING).
std::string Health(const std::string& target) {
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  const grpc::Status status =
      testing::RawUnaryCall(target, "/grpc.health.v1.Health/Check", &req, &resp);
  EXPECT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes += std::string(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

class EndToEndTest : public DaemonTest {};

TEST_F(EndToEndTest, ShadowServesTheReferenceBitForBitAndCountsTheComparison) {
  StartDaemon(testing::TestOptions(testing::TestDir("e2e")));
  const v1::VerifyRequest req = testing::SmallRequest(11, 17, 97, 1);
  const std::string want = LocalOutput(req, Path::kReference);
  for (const std::string& target : daemon_->listen_addresses()) {
    SCOPED_TRACE(target);
    auto stub = v1::VerifyService::NewStub(testing::Channel(target));
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    ASSERT_TRUE(stub->Verify(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
    EXPECT_EQ(resp.mode(), v1::MODE_SHADOW);
    EXPECT_EQ(resp.o().dtype(), v1::DTYPE_BF16);
    EXPECT_TRUE(resp.o().raw_contents() == want) << "served output differs from the reference";
    EXPECT_GT(resp.timing().total_seconds(), 0);
  }
  daemon_->shadow().WaitIdle();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_comparisons_total{outcome=\"match\"}"), 2) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_requests_total{code=\"OK\",path=\"reference\"}"), 2);
  EXPECT_EQ(MetricValue(m, "verifyd_mode{mode=\"shadow\"}"), 1);
  EXPECT_NE(m.find("verifyd_build_info{"), std::string::npos);
  EXPECT_NE(m.find("verifyd_diff_rel_l2_count{pair=\"custom_vs_reference\"} 2"), std::string::npos);
}

TEST_F(EndToEndTest, CompareSyncReturnsTheComparisonAndLse) {
  StartDaemon(testing::TestOptions(testing::TestDir("e2e")));
  v1::VerifyRequest req = testing::SmallRequest(12);
  req.set_compare_sync(true);
  req.set_want_lse(true);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  ASSERT_TRUE(resp.has_comparison());
  EXPECT_TRUE(resp.comparison().match()) << resp.comparison().reason();
  EXPECT_GT(resp.comparison().rel_l2(), 0);
  EXPECT_LT(resp.comparison().rel_l2(), 1e-2);
  EXPECT_EQ(resp.lse().dtype(), v1::DTYPE_F32);
  EXPECT_EQ(resp.lse().shape(0), 6);
}

TEST_F(EndToEndTest, FlipToCustomServesTheCustomPathBitForBit) {
  StartDaemon(testing::TestOptions(testing::TestDir("e2e")));
  const v1::VerifyRequest req = testing::SmallRequest(13, 8, 4096 - 8, 64);
  // Gate: 3 clean comparisons needed; none yet.
  grpc::Status refused = SetMode(v1::MODE_CUSTOM, false);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("gate"), std::string::npos);
  v1::VerifyResponse resp;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Verify(req, &resp).ok());
  daemon_->shadow().WaitIdle();
  EXPECT_TRUE(Status().gate().ready());
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, false).ok());
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_CUSTOM);
  EXPECT_EQ(resp.mode(), v1::MODE_CUSTOM);
  EXPECT_TRUE(resp.o().raw_contents() == LocalOutput(req, Path::kCustom));
  EXPECT_FALSE(resp.o().raw_contents() == LocalOutput(req, Path::kReference));

  ASSERT_TRUE(SetMode(v1::MODE_REFERENCE, false).ok());
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
  const auto s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_REFERENCE);
  ASSERT_GE(s.recent_audit_size(), 2);
  EXPECT_EQ(s.recent_audit(s.recent_audit_size() - 1).to(), v1::MODE_REFERENCE);
}

TEST_F(EndToEndTest, AFailingCustomPathIsCountedAndTheReferenceStillServed) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.inject_custom_fault.kind = CustomFault::Kind::kError;
  StartDaemon(o);
  const v1::VerifyRequest req = testing::SmallRequest(14);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
  daemon_->shadow().WaitIdle();
  // Even forced into custom, the call falls back to the reference.
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
  EXPECT_TRUE(resp.o().raw_contents() == LocalOutput(req, Path::kReference));
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_comparisons_total{outcome=\"error\"}"), 2) << m;
  EXPECT_EQ(Status().counters().comparisons_error(), 2);
  EXPECT_FALSE(Status().gate().ready());
}

TEST_F(EndToEndTest, AWrongCustomPathIsABreachAndRollsCustomBack) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.inject_custom_fault = {CustomFault::Kind::kPerturb, 0.5};
  o.controller.rollback_breaches = 2;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CANARY, true, 1.0).ok());
  v1::VerifyRequest req = testing::SmallRequest(15);
  req.set_compare_sync(true);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_CUSTOM);
  EXPECT_FALSE(resp.comparison().match());
  EXPECT_NE(resp.comparison().reason().find("max_abs"), std::string::npos)
      << resp.comparison().reason();
  EXPECT_EQ(Status().mode(), v1::MODE_CANARY);
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"tolerance\"}"), 1) << m;
  EXPECT_NE(Status().last_rollback_reason().find("auto-rollback"), std::string::npos);
}

TEST_F(EndToEndTest, ARollbackCausedByServedPathErrorsIsCounted) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.inject_custom_fault.kind = CustomFault::Kind::kError;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  const v1::VerifyRequest req = testing::SmallRequest(17);
  int calls = 0;
  while (Status().mode() == v1::MODE_CUSTOM && calls < 10) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
    EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
    ++calls;
  }
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_EQ(calls, o.controller.rollback_breaches);
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"error\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_mode{mode=\"shadow\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_comparisons_total{outcome=\"error\"}"), calls) << m;
}

TEST_F(EndToEndTest, ASlowServedCustomPathIsATimeoutAndRollsBack) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.handler.custom_timeout_seconds = 1e-6;  // every custom run is slower than this
  o.custom_sample_rate = 0;                 // no comparisons: the served path's time alone
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  const v1::VerifyRequest req = testing::SmallRequest(18);
  const std::string custom = LocalOutput(req, Path::kCustom);
  int calls = 0;
  while (Status().mode() == v1::MODE_CUSTOM && calls < 10) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
    // The late output is still the custom path's own.
    EXPECT_EQ(resp.served_path(), v1::PATH_CUSTOM);
    EXPECT_TRUE(resp.o().raw_contents() == custom);
    ++calls;
  }
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_EQ(calls, o.controller.rollback_breaches);
  EXPECT_NE(Status().last_rollback_reason().find("custom_timeout_ms"), std::string::npos)
      << Status().last_rollback_reason();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"timeout\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_comparisons_total{outcome=\"timeout\"}"), calls) << m;
}

TEST_F(EndToEndTest, ASampledSlowServedCustomCallIsOneTimeoutOutcome) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.handler.custom_timeout_seconds = 1e-6;
  o.custom_sample_rate = 1;
  o.controller.rollback_breaches = 100;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  v1::VerifyRequest req = testing::SmallRequest(19);
  req.set_compare_sync(true);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_CUSTOM);
  ASSERT_TRUE(resp.has_comparison());
  EXPECT_FALSE(resp.comparison().match());
  EXPECT_NE(resp.comparison().reason().find("custom_timeout_ms"), std::string::npos);
  const auto c = Status().counters();
  EXPECT_EQ(c.comparisons_error(), 1);  // timeouts count with errors in status
  EXPECT_EQ(c.comparisons_match(), 0);
}

// Whether a bf16 tensor's bytes hold a NaN or an Inf.
bool HasNonFinite(const std::string& bf16) {
  for (size_t i = 0; i + 1 < bf16.size(); i += 2) {
    uint16_t x;
    std::memcpy(&x, bf16.data() + i, 2);
    if ((x & 0x7f80) == 0x7f80) return true;
  }
  return false;
}

TEST_F(EndToEndTest, ANonFiniteCustomOutputIsNeverServed) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.inject_custom_fault.kind = CustomFault::Kind::kNan;
  o.custom_sample_rate = 0;  // no sampled comparisons: only the served output's check
  o.shadow_sample_rate = 0;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  const v1::VerifyRequest req = testing::SmallRequest(20);
  const std::string reference = LocalOutput(req, Path::kReference);
  const int calls = 5;
  for (int i = 0; i < calls; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
    EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
    EXPECT_FALSE(HasNonFinite(resp.o().raw_contents())) << "call " << i;
    EXPECT_TRUE(resp.o().raw_contents() == reference) << "call " << i;
  }
  // The first rollback_breaches calls were breaches in custom mode and rolled it back; the rest
  // were served by the reference in shadow without a comparison.
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_EQ(Status().counters().comparisons_breach(), o.controller.rollback_breaches);
  EXPECT_EQ(Status().counters().served_custom(), 0);
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"nan_inf\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_comparisons_total{outcome=\"breach\"}"),
            o.controller.rollback_breaches);
  EXPECT_NE(Status().last_rollback_reason().find("not finite"), std::string::npos)
      << Status().last_rollback_reason();
}

TEST_F(EndToEndTest, ModeSurvivesARestartWithTheAuditLogIntact) {
  const std::string dir = testing::TestDir("e2e");
  StartDaemon(testing::TestOptions(dir));
  ASSERT_TRUE(SetMode(v1::MODE_CANARY, true, 0.25).ok());
  daemon_.reset();
  StartDaemon(testing::TestOptions(dir));
  const auto s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_CANARY);
  EXPECT_DOUBLE_EQ(s.canary_fraction(), 0.25);
  ASSERT_EQ(s.recent_audit_size(), 1);
  EXPECT_TRUE(s.recent_audit(0).forced());
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_mode{mode=\"canary\"}"), 1);
}

TEST_F(EndToEndTest, HealthIsServingAndTheAdminSocketIsPrivate) {
  const std::string dir = testing::TestDir("e2e");
  StartDaemon(testing::TestOptions(dir));
  EXPECT_EQ(Health(tcp_), std::string("\x08\x01", 2));  // status: SERVING
  struct stat st;
  ASSERT_EQ(::stat((dir + "/admin.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(EndToEndTest, AFatalEngineFaultStopsServingAndRestartsInShadow) {
  const std::string dir = testing::TestDir("e2e");
  StartDaemon(testing::TestOptions(dir));
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  daemon_->OnFatal(absl::DataLossError("sticky CUDA error cudaErrorIllegalAddress in custom path"));
  EXPECT_EQ(daemon_->Wait(), 3);                        // the supervisor restarts it
  EXPECT_EQ(Health(tcp_), std::string("\x08\x02", 2));  // NOT_SERVING
  daemon_.reset();
  StartDaemon(testing::TestOptions(dir));
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  const auto audit = Status().recent_audit();
  ASSERT_FALSE(audit.empty());
  EXPECT_NE(audit.rbegin()->reason().find("custom-path fault"), std::string::npos);
  EXPECT_EQ(SetMode(v1::MODE_CUSTOM, false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(EndToEndTest, ATcpAdminNeedsTheBearerToken) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.admin_listen = "127.0.0.1:0";
  o.admin_token = "s3cret";
  o.insecure_admin_tcp = true;
  StartDaemon(o);
  {
    grpc::ClientContext ctx;
    v1::GetStatusResponse s;
    grpc::Status st = admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer wrong!");
    v1::GetStatusResponse s;
    EXPECT_EQ(admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer s3cret");
  v1::GetStatusResponse s;
  EXPECT_TRUE(admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s).ok());
  EXPECT_EQ(s.mode(), v1::MODE_SHADOW);

  auto no_token = testing::TestOptions(testing::TestDir("e2e2"));
  no_token.admin_listen = "127.0.0.1:0";
  auto d = Daemon::Start(no_token);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("admin_token_file"), std::string::npos);
}

TEST_F(EndToEndTest, AFullShadowQueueSkipsInsteadOfSlowingResponses) {
  if (testing::TestEngine() != "cpu") {
    GTEST_SKIP() << "needs a shadow path slower than the served path (the CPU engine's)";
  }
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.shadow_queue = 1;
  o.shadow_threads = 1;
  StartDaemon(o);
  const v1::VerifyRequest req = testing::SmallRequest(16, 16, 2048, 64);
  std::atomic<bool> done{false};
  double max_depth = 0;
  std::thread scraper([&] {
    while (!done) {
      const std::string m = testing::Scrape(daemon_->metrics_port());
      max_depth = std::max(max_depth, MetricValue(m, "verifyd_shadow_queue_depth"));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto stub = v1::VerifyService::NewStub(testing::Channel(tcp_));
      for (int i = 0; i < 3; ++i) {
        grpc::ClientContext ctx;
        v1::VerifyResponse resp;
        EXPECT_TRUE(stub->Verify(&ctx, req, &resp).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  scraper.join();
  daemon_->shadow().WaitIdle();
  EXPECT_LE(max_depth, 1) << "the queue depth gauge must never exceed --shadow_queue";
  const auto c = daemon_->handler().counters();
  EXPECT_EQ(c.requests(), 12);
  EXPECT_GT(c.comparisons_skipped(), 0);
  EXPECT_EQ(c.comparisons_match() + c.comparisons_skipped(), 12);
}

TEST_F(EndToEndTest, ACanaryCallThatCannotBeComparedIsServedByTheReference) {
  if (testing::TestEngine() != "cpu") {
    GTEST_SKIP() << "needs a shadow path slower than the served path (the CPU engine's)";
  }
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.shadow_queue = 1;
  o.shadow_threads = 1;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CANARY, true, 1.0).ok());
  const v1::VerifyRequest req = testing::SmallRequest(21, 16, 2048, 64);
  std::atomic<int> custom_responses{0}, reference_responses{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      auto stub = v1::VerifyService::NewStub(testing::Channel(tcp_));
      for (int i = 0; i < 4; ++i) {
        grpc::ClientContext ctx;
        v1::VerifyResponse resp;
        EXPECT_TRUE(stub->Verify(&ctx, req, &resp).ok());
        ++(resp.served_path() == v1::PATH_CUSTOM ? custom_responses : reference_responses);
      }
    });
  }
  for (auto& t : threads) t.join();
  daemon_->shadow().WaitIdle();
  const auto c = daemon_->handler().counters();
  EXPECT_EQ(c.requests(), 16);
  EXPECT_EQ(c.served_custom(), custom_responses.load());
  // Every call served by custom was compared; none was skipped.
  EXPECT_EQ(c.comparisons_match() + c.comparisons_breach() + c.comparisons_error(),
            c.served_custom());
  EXPECT_EQ(c.comparisons_skipped(), 0);
  EXPECT_GT(c.served_custom(), 0);
  const std::string m = testing::Scrape(daemon_->metrics_port());
  const double shed = MetricValue(m, "verifyd_canary_shed_total");
  EXPECT_GT(shed, 0) << m;
  EXPECT_EQ(shed, reference_responses.load());
  EXPECT_EQ(c.served_reference(), reference_responses.load());
}

TEST_F(EndToEndTest, AnAbandonedCallStopsComputingAndIsCountedAsSuch) {
  if (testing::TestEngine() != "cpu") {
    GTEST_SKIP() << "needs a request that takes seconds (the CPU engine's)";
  }
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.shadow_sample_rate = 0;
  StartDaemon(o);
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 16;
  spec.heads = 64;  // seconds of work even on an idle machine; the message stays ~21 MB
  spec.prefix = 8192;
  spec.page_size = 64;
  spec.seed = 22;
  RandomBundle big_bundle(spec);
  v1::VerifyRequest big;
  EncodeRequest(big_bundle.view(), &big);
  {
    grpc::ClientContext ctx;
    // Long enough for the 21 MB request to arrive, far shorter than computing it (seconds).
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
    v1::VerifyResponse resp;
    EXPECT_EQ(verify_->Verify(&ctx, big, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // The daemon stopped computing: a small call right after is not queued behind the big one.
  const auto t = std::chrono::steady_clock::now();
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(testing::SmallRequest(23), &resp).ok());
  const double small_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  EXPECT_LT(small_s, 1.0);
  // The abandoned call is counted by its code once the engine noticed (between tiles).
  std::string m;
  for (int i = 0; i < 250; ++i) {
    m = testing::Scrape(daemon_->metrics_port());
    if (m.find("code=\"DEADLINE_EXCEEDED\"") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(m.find("verifyd_requests_total{code=\"DEADLINE_EXCEEDED\""), std::string::npos) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_requests_total{code=\"OK\",path=\"reference\"}"), 1) << m;
}

TEST_F(EndToEndTest, ACallOverTheWorkCeilingIsRefusedUpFront) {
  auto o = testing::TestOptions(testing::TestDir("e2e"));
  o.handler.max_call_work = 1000;
  StartDaemon(o);
  v1::VerifyResponse resp;
  const grpc::Status st = Verify(testing::SmallRequest(24), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("--max_call_work=1000"), std::string::npos)
      << st.error_message();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_requests_total{code=\"RESOURCE_EXHAUSTED\",path=\"none\"}"), 1)
      << m;
}

}  // namespace
}  // namespace verifyd
