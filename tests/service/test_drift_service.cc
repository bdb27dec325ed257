// Oracle drift through the running daemon over real gRPC and /metrics: a custom path whose P·V
// accumulator is kept in bf16 stays within every per-call tolerance on concentrated traffic, and
// the drift test still closes the gate in shadow, refuses the flip and rolls back from custom.

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::MetricValue;

// Concentrated attention (sinks, recency, heavy hitters): where the bf16 accumulator passes
// the per-call check.
v1::VerifyRequest RealisticRequest(uint64_t seed) {
  RandomBundleSpec spec;
  spec.batch = 1;
  spec.draft = 4;
  spec.heads = 8;
  spec.prefix = 500;
  spec.page_size = 16;
  spec.traffic = Traffic::kRealistic;
  spec.seed = seed;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  req.set_compare_sync(true);
  return req;
}

class DriftServiceTest : public testing::DaemonTest {
 protected:
  void StartWith(CustomFault::Kind fault) {
    auto o = testing::TestOptions(testing::TestDir("drift"));
    o.inject_custom_fault.kind = fault;
    o.handler.oracle_sample_rate = 1;
    o.controller.gate_window = 3;
    StartDaemon(o);
  }
  // Sends `n` calls; every comparison must match (within tolerance).
  void SendMatching(int n, uint64_t seed0) {
    for (int i = 0; i < n; ++i) {
      v1::VerifyResponse resp;
      ASSERT_TRUE(Verify(RealisticRequest(seed0 + i), &resp).ok());
    }
    daemon_->shadow().WaitIdle();
  }
  std::string Metrics() { return testing::Scrape(daemon_->metrics_port()); }
};

TEST_F(DriftServiceTest, CleanCustomPathShowsNoDrift) {
  if (testing::TestEngine() != "cpu") GTEST_SKIP() << "the CPU engine's custom path";
  StartWith(CustomFault::Kind::kNone);
  SendMatching(24, 1);
  const v1::GetStatusResponse s = Status();
  EXPECT_EQ(s.counters().comparisons_breach(), 0);
  EXPECT_EQ(s.drift().samples(), 24);
  EXPECT_FALSE(s.drift().breach());
  EXPECT_LT(s.drift().ratio(), 1.2);
  EXPECT_EQ(s.drift().breaches(), 0);
  EXPECT_TRUE(s.gate().ready());
  const std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_drift_breaches_total"), 0) << m;
  EXPECT_GT(MetricValue(m, "verifyd_drift_ratio"), 0.8) << m;
}

TEST_F(DriftServiceTest, Bf16AccumulatorDriftsClosesTheGateAndRollsBackFromCustom) {
  if (testing::TestEngine() != "cpu") GTEST_SKIP() << "bf16_pv is a CPU-engine fault";
  StartWith(CustomFault::Kind::kBf16Pv);
  SendMatching(DriftOptions{}.min_samples, 1);
  v1::GetStatusResponse s = Status();
  // Every call within tolerance...
  EXPECT_EQ(s.counters().comparisons_breach(), 0);
  EXPECT_EQ(s.counters().comparisons_match(), DriftOptions{}.min_samples);
  // ...and still the drift test is in breach, and the gate closed.
  EXPECT_TRUE(s.drift().breach()) << s.drift().ShortDebugString();
  EXPECT_GT(s.drift().ratio(), 1.35);
  EXPECT_EQ(s.drift().breaches(), 1);
  EXPECT_NE(s.drift().last_breach().find("custom's error vs the oracle"), std::string::npos);
  EXPECT_FALSE(s.gate().ready());
  EXPECT_NE(s.gate().reason().find("oracle drift"), std::string::npos) << s.gate().reason();
  std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_drift_breaches_total"), 1) << m;
  EXPECT_GT(MetricValue(m, "verifyd_drift_ratio"), 1.35) << m;
  EXPECT_GE(MetricValue(m, "verifyd_drift_t"), DriftOptions{}.min_t) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_gate_ready"), 0) << m;

  // The gate refuses the flip; --force records it, and the next oracle sample rolls it back.
  grpc::Status flip = SetMode(v1::MODE_CUSTOM, false);
  EXPECT_EQ(flip.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(flip.error_message().find("oracle drift"), std::string::npos) << flip.error_message();
  ASSERT_TRUE(SetMode(v1::MODE_CUSTOM, true).ok());
  {
    v1::SetSamplingRequest req;
    req.set_mode(v1::MODE_CUSTOM);
    req.set_rate(1);
    req.set_reason("test: compare every custom call");
    v1::SetSamplingResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->SetSampling(&ctx, req, &resp).ok());
  }
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(RealisticRequest(1000), &resp).ok());
  EXPECT_EQ(resp.served_path(), v1::PATH_CUSTOM);
  daemon_->shadow().WaitIdle();
  s = Status();
  EXPECT_EQ(s.mode(), v1::MODE_SHADOW);
  EXPECT_EQ(s.counters().rollbacks(), 1);
  EXPECT_NE(s.last_rollback_reason().find("drift: auto-rollback: oracle drift"), std::string::npos)
      << s.last_rollback_reason();
  EXPECT_EQ(s.counters().comparisons_breach(), 0);  // no single call breached
  m = Metrics();
  EXPECT_EQ(MetricValue(m, "verifyd_rollbacks_total{reason=\"drift\"}"), 1) << m;
  EXPECT_EQ(MetricValue(m, "verifyd_mode{mode=\"shadow\"}"), 1) << m;
}

}  // namespace
}  // namespace verifyd
