// The mode controller through the running daemon, over real gRPC and /metrics: rollbacks the
// daemon makes by itself are counted, state.json binds the gate to the build, a bad state file
// stops the start, and a damaged audit log does not break status.

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::MetricValue;

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  return last;
}

class ModeServiceTest : public testing::DaemonTest {
 protected:
  std::string Metrics() { return testing::Scrape(daemon_->metrics_port()); }
  void VerifySync(int n) {
    for (int i = 0; i < n; ++i) {
      v1::VerifyRequest req = testing::SmallRequest(100 + i);
      req.set_compare_sync(true);
      v1::VerifyResponse resp;
      ASSERT_TRUE(Verify(req, &resp).ok());
    }
  }
};

TEST_F(ModeServiceTest, CustomPathErrorsInCustomModeAreCountedAsRollbacks) {
  auto o = testing::TestOptions(testing::TestDir("mode"));
  o.inject_custom_fault.kind = CustomFault::Kind::kError;
  o.controller.rollback_breaches = 2;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  const v1::VerifyRequest req = testing::SmallRequest(14);
  v1::VerifyResponse resp;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(Verify(req, &resp).ok());
    EXPECT_EQ(resp.served_path(), v1::PATH_REFERENCE);
  }
  daemon_->shadow().WaitIdle();
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  const std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"error\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_mode{mode=\"shadow\"}"), 1) << m;
  EXPECT_EQ(Status().counters().rollbacks(), 1);
}

TEST_F(ModeServiceTest, ARestartUnderTheSameBuildKeepsTheGateOpen) {
  const std::string dir = testing::TestDir("mode");
  StartDaemon(testing::TestOptions(dir));  // gate_window 3
  VerifySync(3);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, false).ok()) << Status().gate().reason();
  std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_mode_forced"), 0) << m;
  daemon_.reset();
  StartDaemon(testing::TestOptions(dir));
  const auto s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_CUSTOM);
  EXPECT_TRUE(s.gate().ready()) << s.gate().reason();
  EXPECT_EQ(s.gate().clean(), 3);
  m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_gate_ready"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_mode_forced"), 0) << m;
}

TEST_F(ModeServiceTest, AForcedFlipIsShownAtOnceAndAcrossARestart) {
  const std::string dir = testing::TestDir("mode");
  StartDaemon(testing::TestOptions(dir));
  ASSERT_TRUE(SetMode(v1::MODE_CANARY, true, 0.5).ok());
  EXPECT_EQ(MetricValue(Metrics(), "verifyd_mode_forced"), 1);
  daemon_.reset();
  StartDaemon(testing::TestOptions(dir));
  EXPECT_EQ(MetricValue(Metrics(), "verifyd_mode_forced"), 1);
  ASSERT_TRUE(SetMode(v1::MODE_SHADOW, false).ok());
  EXPECT_EQ(MetricValue(Metrics(), "verifyd_mode_forced"), 0);
}

TEST_F(ModeServiceTest, ARestartWithAnotherCustomConfigurationComesBackInShadow) {
  const std::string dir = testing::TestDir("mode");
  StartDaemon(testing::TestOptions(dir));
  VerifySync(3);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, false).ok());
  daemon_.reset();
  auto o = testing::TestOptions(dir);
  o.handler.tolerance.max_rel_l2 = 0.5;  // verdicts under other tolerances are other evidence
  StartDaemon(o);
  const auto s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_SHADOW);
  EXPECT_FALSE(s.gate().ready());
  ASSERT_GE(s.recent_audit_size(), 1);
  const auto& last = s.recent_audit(s.recent_audit_size() - 1);
  EXPECT_EQ(last.who(), "verifyd");
  EXPECT_NE(last.reason().find("restart under build"), std::string::npos) << last.reason();
  EXPECT_NE(LastLine(dir + "/state/audit.jsonl").find("\"origin\":\"daemon\""), std::string::npos);
  EXPECT_EQ(MetricValue(Metrics(), "verifyd_rollbacks_total{reason=\"build_changed\"}"), 1);
  EXPECT_EQ(SetMode(v1::MODE_CUSTOM, false).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(ModeServiceTest, AStateFileThatCannotBeReadStopsTheStart) {
  const std::string dir = testing::TestDir("mode");
  std::filesystem::create_directories(dir + "/state/state.json");
  auto d = Daemon::Start(testing::TestOptions(dir));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("state.json"), std::string::npos) << d.status();
}

TEST_F(ModeServiceTest, AStateFileThatCannotBeOpenedStopsTheStart) {
  const std::string dir = testing::TestDir("mode");
  std::filesystem::create_directories(dir + "/state");
  std::filesystem::create_symlink("state.json", dir + "/state/state.json");  // ELOOP
  auto d = Daemon::Start(testing::TestOptions(dir));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("state.json cannot be opened"), std::string::npos)
      << d.status();
}

TEST_F(ModeServiceTest, OutOfRangeStateValuesStopTheStart) {
  const std::string dir = testing::TestDir("mode");
  std::filesystem::create_directories(dir + "/state");
  std::ofstream(dir + "/state/state.json")
      << R"({"mode":"canary","canary_fraction":7,"shadow_sample_rate":-3,"custom_sample_rate":42})";
  auto d = Daemon::Start(testing::TestOptions(dir));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("canary_fraction: 7"), std::string::npos) << d.status();
}

TEST_F(ModeServiceTest, AMalformedAuditLineDoesNotBreakStatus) {
  const std::string dir = testing::TestDir("mode");
  StartDaemon(testing::TestOptions(dir));
  ASSERT_TRUE(SetMode(v1::MODE_REFERENCE, false).ok());
  std::ofstream(dir + "/state/audit.jsonl", std::ios::app) << R"({"to":5})"
                                                           << "\n";
  ASSERT_TRUE(SetMode(v1::MODE_SHADOW, false).ok());
  v1::GetStatusResponse s;
  grpc::ClientContext ctx;
  grpc::Status st = admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(s.recent_audit_size(), 2);
  EXPECT_EQ(s.recent_audit(1).to(), v1::MODE_SHADOW);
  EXPECT_EQ(daemon_->controller().MalformedAuditLines(), 1);
}

TEST_F(ModeServiceTest, SamplingChangesAreAuditedAsTheClientsWhateverNameItClaims) {
  const std::string dir = testing::TestDir("mode");
  StartDaemon(testing::TestOptions(dir));
  v1::SetSamplingRequest req;
  req.set_mode(v1::MODE_SHADOW);
  req.set_rate(0);
  req.set_reason("test");
  req.set_who("verifyd");
  v1::SetSamplingResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(admin_->SetSampling(&ctx, req, &resp).ok());
  const std::string line = LastLine(dir + "/state/audit.jsonl");
  EXPECT_NE(line.find("\"action\":\"sample_rate\""), std::string::npos) << line;
  EXPECT_NE(line.find("\"origin\":\"client\""), std::string::npos) << line;
  EXPECT_NE(line.find("\"who\":\"verifyd\""), std::string::npos) << line;
  EXPECT_NE(line.find("\"sample_rate\":0"), std::string::npos) << line;
}

TEST_F(ModeServiceTest, SamplingNeedsAReasonAndCustomZeroNeedsForce) {
  StartDaemon(testing::TestOptions(testing::TestDir("mode")));
  v1::SetSamplingRequest req;
  req.set_mode(v1::MODE_CUSTOM);
  req.set_rate(0);
  v1::SetSamplingResponse resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = admin_->SetSampling(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("reason"), std::string::npos) << st.error_message();
  }
  req.set_reason("too slow");
  {
    grpc::ClientContext ctx;
    const grpc::Status st = admin_->SetSampling(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(st.error_message().find("--force"), std::string::npos) << st.error_message();
  }
  EXPECT_NE(Status().custom_sample_rate(), 0);
  req.set_force(true);
  grpc::ClientContext ctx;
  ASSERT_TRUE(admin_->SetSampling(&ctx, req, &resp).ok());
  EXPECT_EQ(Status().custom_sample_rate(), 0);
}

}  // namespace
}  // namespace verifyd
