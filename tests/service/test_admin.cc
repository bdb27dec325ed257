// The admin API over real gRPC: who a change is recorded as (the kernel's uid on the Unix socket,
// the token's identity on TCP, the client's claim kept apart), what the daemon runs with in
// GetStatus, and failed authentications (counted, logged at a bounded rate).

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "prometheus/text_serializer.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "src/server/admin_service.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;

using testing::MetricValue;

grpc::Status SetModeAs(v1::AdminService::Stub* admin, const std::string& token,
                       const std::string& who, v1::Mode mode, double fraction = 0) {
  v1::SetModeRequest req;
  req.set_mode(mode);
  req.set_force(true);
  req.set_canary_fraction(fraction);
  req.set_reason("test");
  req.set_who(who);
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::SetModeResponse resp;
  return admin->SetMode(&ctx, req, &resp);
}

// Log lines, captured for the test's lifetime.
class LogCapture {
 public:
  LogCapture()
      : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256)),
        previous_(spdlog::default_logger()) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink_));
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  std::vector<std::string> Lines(const std::string& containing) const {
    std::vector<std::string> out;
    for (const std::string& l : sink_->last_formatted()) {
      if (l.find(containing) != std::string::npos) out.push_back(l);
    }
    return out;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
  std::shared_ptr<spdlog::logger> previous_;
};

class AdminTest : public DaemonTest {};

TEST_F(AdminTest, TheUnixSocketRecordsTheKernelUidBesideTheClaimedName) {
  const std::string dir = testing::TestDir("admin");
  StartDaemon(testing::TestOptions(dir));
  ASSERT_TRUE(SetModeAs(admin_.get(), "", "alice@elsewhere", v1::MODE_REFERENCE).ok());
  const auto s = Status();
  ASSERT_EQ(s.recent_audit_size(), 1);
  EXPECT_EQ(s.recent_audit(0).who(), "alice@elsewhere");  // the claim, kept as it was
  const std::string uid = "uid:" + std::to_string(::getuid());
  EXPECT_EQ(s.recent_audit(0).peer().substr(0, uid.size()), uid) << s.recent_audit(0).peer();
  // The socket is still private, and it is gone when the daemon stops.
  struct stat st;
  ASSERT_EQ(::stat((dir + "/admin.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  daemon_.reset();
  EXPECT_NE(::stat((dir + "/admin.sock").c_str(), &st), 0);
  // The peer survives a restart (it is in audit.jsonl).
  StartDaemon(testing::TestOptions(dir));
  EXPECT_EQ(Status().recent_audit(0).peer().substr(0, uid.size()), uid);
}

// The series of verifyd_last_change_info in a /metrics text.
std::vector<std::string> LastChangeSeries(const std::string& metrics) {
  std::vector<std::string> out;
  std::istringstream in(metrics);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("verifyd_last_change_info{", 0) == 0) out.push_back(l);
  }
  std::sort(out.begin(), out.end());  // "mode" before "sample_rate"
  return out;
}

// What alerts show as who made the last change: the peer the kernel verified on the Unix socket,
// never the name the client claims; one series per action, replaced by the next change, and
// known again after a restart.
TEST_F(AdminTest, TheLastChangeMetricCarriesTheVerifiedPeerNotTheClaimedName) {
  const std::string dir = testing::TestDir("admin");
  StartDaemon(testing::TestOptions(dir));
  EXPECT_TRUE(LastChangeSeries(testing::Scrape(daemon_->metrics_port())).empty());
  const std::string peer = "peer=\"uid:" + std::to_string(::getuid()) + "(";
  ASSERT_TRUE(SetModeAs(admin_.get(), "", "mallory@claimed", v1::MODE_CUSTOM).ok());
  std::vector<std::string> series = LastChangeSeries(testing::Scrape(daemon_->metrics_port()));
  ASSERT_EQ(series.size(), 1u);
  EXPECT_EQ(series[0].rfind("verifyd_last_change_info{action=\"mode\"," + peer, 0), 0u)
      << series[0];
  EXPECT_EQ(series[0].find("mallory"), std::string::npos) << series[0];
  EXPECT_EQ(series[0].substr(series[0].size() - 2), " 1") << series[0];

  // A sample rate change gets its own series; another flip replaces the mode's.
  v1::SetSamplingRequest sample;
  sample.set_mode(v1::MODE_CUSTOM);
  sample.set_rate(0);
  sample.set_force(true);
  sample.set_reason("test");
  sample.set_who("eve@claimed");
  v1::SetSamplingResponse sampled;
  grpc::ClientContext ctx;
  ASSERT_TRUE(admin_->SetSampling(&ctx, sample, &sampled).ok());
  ASSERT_TRUE(SetModeAs(admin_.get(), "", "trudy@claimed", v1::MODE_SHADOW).ok());
  series = LastChangeSeries(testing::Scrape(daemon_->metrics_port()));
  ASSERT_EQ(series.size(), 2u) << series[0];
  EXPECT_EQ(series[0].rfind("verifyd_last_change_info{action=\"mode\"," + peer, 0), 0u)
      << series[0];
  EXPECT_EQ(series[1].rfind("verifyd_last_change_info{action=\"sample_rate\"," + peer, 0), 0u)
      << series[1];
  for (const std::string& l : series) {
    for (const char* claimed : {"mallory", "eve", "trudy"}) {
      EXPECT_EQ(l.find(claimed), std::string::npos) << l;
    }
  }

  // After a restart the series come from the audit log; a start-up flag's change is verifyd's.
  daemon_.reset();
  DaemonOptions o = testing::TestOptions(dir);
  o.shadow_sample_rate = 0.5;
  StartDaemon(o);
  series = LastChangeSeries(testing::Scrape(daemon_->metrics_port()));
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0].rfind("verifyd_last_change_info{action=\"mode\"," + peer, 0), 0u)
      << series[0];
  EXPECT_EQ(series[1], "verifyd_last_change_info{action=\"sample_rate\",peer=\"verifyd\"} 1");
}

TEST_F(AdminTest, TcpRecordsTheTokenIdentityNotTheToken) {
  auto o = testing::TestOptions(testing::TestDir("admin"));
  o.admin_listen = "127.0.0.1:0";
  o.admin_token = "s3cret";
  o.insecure_admin_tcp = true;  // plaintext loopback; TLS is covered by test_tls
  StartDaemon(o);
  ASSERT_TRUE(SetModeAs(admin_.get(), "s3cret", "verifyd", v1::MODE_REFERENCE).ok());
  const auto audit = daemon_->controller().RecentAudit(10);
  ASSERT_EQ(audit.size(), 1u);
  EXPECT_EQ(audit[0].who, "verifyd");
  EXPECT_EQ(audit[0].peer, "token:1ec1c26b");  // sha256("s3cret") starts 1ec1c26b
  EXPECT_EQ(TokenIdentity("s3cret"), "token:1ec1c26b");
  EXPECT_EQ(LastChangeSeries(testing::Scrape(daemon_->metrics_port())),
            std::vector<std::string>{
                "verifyd_last_change_info{action=\"mode\",peer=\"token:1ec1c26b\"} 1"});
}

TEST_F(AdminTest, OnlyCanaryTakesAFraction) {
  StartDaemon(testing::TestOptions(testing::TestDir("admin")));
  grpc::Status st = SetModeAs(admin_.get(), "", "t", v1::MODE_CUSTOM, 0.3);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("canary_fraction"), std::string::npos) << st.error_message();
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_TRUE(SetModeAs(admin_.get(), "", "t", v1::MODE_CANARY, 0.3).ok());
}

TEST_F(AdminTest, StatusShowsWhatTheDaemonRunsWith) {
  auto o = testing::TestOptions(testing::TestDir("admin"));
  o.inject_custom_fault.kind = CustomFault::Kind::kPerturb;
  o.inject_custom_fault.amount = 0.5;
  o.handler.tolerance.atol = 0.03;
  o.handler.tolerance.max_rel_l2 = 0.002;
  o.handler.oracle_sample_rate = 0.25;
  o.handler.custom_timeout_seconds = 0.5;
  o.controller.rollback_breaches = 7;
  o.controller.rollback_window = 70;
  StartDaemon(o);
  // Uptime counts: wait until it passes one second (observed, not slept for).
  auto r = Status().runtime();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (r.uptime_seconds() < 1.0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    r = Status().runtime();
  }
  EXPECT_EQ(r.inject_custom_fault(), "perturb:0.5");
  EXPECT_DOUBLE_EQ(r.tolerances().atol(), 0.03);
  EXPECT_DOUBLE_EQ(r.tolerances().rtol(), Tolerance().rtol);
  EXPECT_DOUBLE_EQ(r.tolerances().max_rel_l2(), 0.002);
  EXPECT_DOUBLE_EQ(r.oracle_sample_rate(), 0.25);
  EXPECT_DOUBLE_EQ(r.custom_timeout_ms(), 500);
  EXPECT_EQ(r.rollback_breaches(), 7);
  EXPECT_EQ(r.rollback_window(), 70);
  EXPECT_EQ(r.gate_window(), 3);
  EXPECT_GE(r.uptime_seconds(), 1.0);
  EXPECT_LT(r.uptime_seconds(), 60.0);
  EXPECT_EQ(r.started().size(), 20u) << r.started();  // 2026-01-02T03:04:05Z
  EXPECT_EQ(Status().regions_size(), 0);              // none registered
  ASSERT_EQ(r.listen_size(), 2);
  EXPECT_EQ(r.listen(0), tcp_);  // as bound, port resolved
  EXPECT_EQ(r.admin_listen(), daemon_->admin_address());
  EXPECT_EQ(r.metrics_address(), "127.0.0.1:" + std::to_string(daemon_->metrics_port()));

  daemon_.reset();
  StartDaemon(testing::TestOptions(testing::TestDir("admin2")));
  EXPECT_EQ(Status().runtime().inject_custom_fault(), "");  // none
}

TEST_F(AdminTest, FailedAuthenticationsAreCountedFromZero) {
  auto o = testing::TestOptions(testing::TestDir("admin"));
  o.admin_listen = "127.0.0.1:0";
  o.admin_token = "s3cret";
  o.insecure_admin_tcp = true;  // plaintext loopback; TLS is covered by test_tls
  StartDaemon(o);
  EXPECT_EQ(
      MetricValue(testing::Scrape(daemon_->metrics_port()), "verifyd_admin_auth_failures_total"),
      0);
  for (const char* token : {"", "wrong", "s3cret!"}) {
    grpc::ClientContext ctx;
    if (*token) ctx.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::GetStatusResponse s;
    EXPECT_EQ(admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(SetModeAs(admin_.get(), "nope", "x", v1::MODE_REFERENCE).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(SetModeAs(admin_.get(), "s3cret", "x", v1::MODE_REFERENCE).ok());
  EXPECT_EQ(
      MetricValue(testing::Scrape(daemon_->metrics_port()), "verifyd_admin_auth_failures_total"),
      4);
}

// The service on its own TCP listener, with a short log interval.
TEST(AdminAuthLogTest, FailuresAreLoggedAtMostOncePerIntervalWithTheCountOfTheRest) {
  const std::string dir = testing::TestDir("authlog");
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto controller = ModeController::Create(std::move(*store), ControllerOptions());
  ASSERT_TRUE(controller.ok()) << controller.status();
  Metrics metrics(BuildInfo{});
  AdminContext actx;
  actx.controller = controller->get();
  actx.metrics = &metrics;
  actx.token = "s3cret";
  actx.auth_log_interval = std::chrono::milliseconds(500);
  AdminServiceImpl service(std::move(actx));
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  ASSERT_TRUE(server && port != 0);
  auto admin = v1::AdminService::NewStub(testing::Channel("127.0.0.1:" + std::to_string(port)));

  LogCapture log;
  auto bad_call = [&] {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer guess");
    v1::GetStatusResponse s;
    return admin->GetStatus(&ctx, v1::GetStatusRequest(), &s).error_code();
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) ASSERT_EQ(bad_call(), grpc::StatusCode::UNAUTHENTICATED);
  ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(450));
  auto lines = log.Lines("admin authentication failed");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("bad bearer token"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("127.0.0.1"), std::string::npos) << lines[0];  // from whom
  EXPECT_EQ(lines[0].find("guess"), std::string::npos) << lines[0];      // never the token

  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  ASSERT_EQ(bad_call(), grpc::StatusCode::UNAUTHENTICATED);
  lines = log.Lines("admin authentication failed");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("and 4 more"), std::string::npos) << lines[1];

  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, metrics.registry()->Collect());
  EXPECT_EQ(MetricValue(text.str(), "verifyd_admin_auth_failures_total"), 6);
  server->Shutdown();
}

}  // namespace
}  // namespace verifyd
