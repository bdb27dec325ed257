// The daemon end to end over real gRPC (TCP port 0 and a Unix socket) on the CPU engine:
// responses equal the served path's output bit for bit, /metrics counts comparisons, flips change
// what is served, a failing custom path is isolated, health and admin auth.

#include <fstream>

#include <sys/stat.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "grpcpp/generic/generic_stub.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;

// The bytes a path produces for `req`, computed in-process by a separate CPU engine.
std::string LocalOutput(const v1::VerifyRequest& req, Path path) {
  auto view = DecodeRequest(req);
  EXPECT_TRUE(view.ok()) << view.status();
  auto engine = testing::LocalEngine();
  auto prepared = engine->Prepare(*view, false);
  EXPECT_TRUE(prepared.ok());
  EXPECT_TRUE(engine->Run(path, **prepared).ok());
  PathOutput out;
  EXPECT_TRUE(engine->Fetch(path, **prepared, &out).ok());
  return std::string(reinterpret_cast<const char*>(out.o.data()), out.o.size() * 2);
}

double MetricValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

// grpc.health.v1.Health/Check for the whole server; returns the serialized HealthCheckResponse
// ("\x08\x01" = SERVING, "\x08\x02" = NOT_SERVING).
std::string Health(const std::string& target) {
  grpc::GenericStub generic(testing::Channel(target));
  grpc::ClientContext ctx;
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      status = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return done; });
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
  EXPECT_EQ(daemon_->Wait(), 3);  // the supervisor restarts it
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
  daemon_->shadow().WaitIdle();
  const auto c = daemon_->handler().counters();
  EXPECT_EQ(c.requests(), 12);
  EXPECT_GT(c.comparisons_skipped(), 0);
  EXPECT_EQ(c.comparisons_match() + c.comparisons_skipped(), 12);
}

}  // namespace
}  // namespace verifyd
