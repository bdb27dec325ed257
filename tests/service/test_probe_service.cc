// The probe suite through the running daemon over real gRPC and /metrics: it runs at start-up
// and the gate needs it; verifyd's RunProbes answers per probe; a wrong custom path fails it,
// the flip is refused, and a failure while custom is served rolls back (reason "probe"), on
// demand and every --probe_interval, with the failing bundle captured.

#include <chrono>
#include <filesystem>
#include <thread>

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::MetricValue;

class ProbeServiceTest : public testing::DaemonTest {
 protected:
  DaemonOptions Options(CustomFault fault) {
    dir_ = testing::TestDir("probe");
    auto o = testing::TestOptions(dir_);
    o.inject_custom_fault = fault;
    o.probe.at_start = true;
    o.probe.interval_seconds = 0;
    o.probe.suite.max_prefix = 256;
    o.capture.dir = dir_ + "/captures";
    return o;
  }
  grpc::Status RunProbes(v1::RunProbesResponse* resp) {
    grpc::ClientContext ctx;
    return admin_->RunProbes(&ctx, v1::RunProbesRequest(), resp);
  }
  void SetCustomSampling(double rate) {
    v1::SetSamplingRequest req;
    req.set_mode(v1::MODE_CUSTOM);
    req.set_rate(rate);
    req.set_reason("test");
    req.set_force(true);
    v1::SetSamplingResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->SetSampling(&ctx, req, &resp).ok());
  }
  int CaptureFiles() {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir_ + "/captures")) {
      n += e.path().extension() == ".safetensors";
    }
    return n;
  }
  std::string Metrics() { return testing::Scrape(daemon_->metrics_port()); }
  std::string dir_;
};

TEST_F(ProbeServiceTest, ACleanEnginePassesAtStartAndOnDemandAndTheGateOpens) {
  StartDaemon(Options({}));
  v1::GetStatusResponse s = Status();
  EXPECT_TRUE(s.probe().has_run());
  EXPECT_TRUE(s.probe().last_passed()) << s.probe().last_summary();
  EXPECT_EQ(s.probe().last_trigger(), "start");
  EXPECT_EQ(s.probe().runs(), 1);
  EXPECT_EQ(s.probe().max_prefix(), 256);
  for (int i = 0; i < 3; ++i) {
    v1::VerifyRequest req = testing::SmallRequest(10 + i);
    req.set_compare_sync(true);
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
  }
  EXPECT_TRUE(Status().gate().ready()) << Status().gate().reason();

  v1::RunProbesResponse r;
  ASSERT_TRUE(RunProbes(&r).ok());
  EXPECT_TRUE(r.passed()) << r.summary();
  EXPECT_GT(r.results_size(), 10);
  for (const auto& p : r.results()) {
    EXPECT_TRUE(p.passed()) << p.name() << ": " << p.reason();
    EXPECT_FALSE(p.feature().empty());
  }
  const std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_probe_runs_total"), 2) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_probe_failures_total"), 0) << m;
  EXPECT_GT(MetricValue(m, "verifyd_probe_last_duration_seconds"), 0) << m;
  EXPECT_TRUE(SetMode(v1::MODE_CUSTOM, false).ok());
  EXPECT_EQ(CaptureFiles(), 0);
}

TEST_F(ProbeServiceTest, AWrongCustomPathFailsTheProbeRefusesTheFlipAndRollsBack) {
  StartDaemon(Options({CustomFault::Kind::kPerturb, 0.05}));
  v1::GetStatusResponse s = Status();
  EXPECT_TRUE(s.probe().has_run());
  EXPECT_FALSE(s.probe().last_passed());
  EXPECT_EQ(s.probe().failed_runs(), 1);
  EXPECT_NE(s.gate().reason().find("the probe suite failed"), std::string::npos)
      << s.gate().reason();
  EXPECT_NE(s.gate().last_breach().find("probe: "), std::string::npos);
  EXPECT_EQ(CaptureFiles(), 1);  // the start-up failure, captured like a breach

  grpc::Status flip = SetMode(v1::MODE_CUSTOM, false);
  EXPECT_EQ(flip.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(flip.error_message().find("probe suite failed"), std::string::npos)
      << flip.error_message();

  // --force still flips (and is recorded); no call compares in custom, so only the probe can
  // roll it back.
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  SetCustomSampling(0);
  v1::RunProbesResponse r;
  ASSERT_TRUE(RunProbes(&r).ok());
  EXPECT_FALSE(r.passed());
  int failed = 0;
  for (const auto& p : r.results()) {
    if (!p.passed()) {
      ++failed;
      EXPECT_FALSE(p.reason().empty()) << p.name();
      EXPECT_GT(p.max_row_rel_l2(), 0.01) << p.name();
    }
  }
  EXPECT_GT(failed, 0);
  s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_SHADOW);
  EXPECT_EQ(s.counters().rollbacks(), 1);
  EXPECT_NE(s.last_rollback_reason().find("probe: auto-rollback: probe suite:"), std::string::npos)
      << s.last_rollback_reason();
  const std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"probe\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_probe_failures_total"), 2) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_probe_runs_total"), 2) << m;
}

TEST_F(ProbeServiceTest, TheIntervalProbeRollsBackFromCustom) {
  DaemonOptions o = Options({CustomFault::Kind::kPerturb, 0.05});
  o.probe.interval_seconds = 0.2;
  StartDaemon(o);
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  SetCustomSampling(0);
  // Waits for the rollback (seconds under the sanitizers on a loaded machine).
  v1::GetStatusResponse s;
  for (int i = 0; i < 600; ++i) {
    s = Status();
    if (s.mode() == v1::MODE_SHADOW) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(s.mode(), v1::MODE_SHADOW);
  EXPECT_EQ(s.probe().last_trigger(), "interval");
  EXPECT_GE(s.probe().failed_runs(), 2);
  EXPECT_EQ(MetricValue(Metrics(), "verifyd_rollbacks_total{reason=\"probe\"}"), 1);
  // Back in shadow the interval probe stops: the run count holds still (after a run that was
  // under way at the rollback has finished).
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const int64_t runs = Status().probe().runs();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(Status().probe().runs(), runs);
}

TEST_F(ProbeServiceTest, WithoutTheStartUpProbeTheGateDoesNotWaitForIt) {
  DaemonOptions o = Options({});
  o.probe.at_start = false;
  StartDaemon(o);
  EXPECT_FALSE(Status().probe().has_run());
  for (int i = 0; i < 3; ++i) {
    v1::VerifyRequest req = testing::SmallRequest(20 + i);
    req.set_compare_sync(true);
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
  }
  EXPECT_TRUE(Status().gate().ready()) << Status().gate().reason();
}

}  // namespace
}  // namespace verifyd
