// The mode state machine: gate, force, canary selection, rollback, durability.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "src/control/mode_controller.h"

namespace verifyd {
namespace {

ModeChange MC(Mode m, double fraction, std::string reason, bool force, std::string who) {
  ModeChange c;
  c.mode = m;
  c.canary_fraction = fraction;
  c.reason = std::move(reason);
  c.force = force;
  c.who = std::move(who);
  return c;
}

class ModeControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("mode_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<ModeController> Make(ControllerOptions o = {}) {
    auto c = TryMake(std::move(o));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  absl::StatusOr<std::unique_ptr<ModeController>> TryMake(ControllerOptions o = {}) {
    auto store = StateStore::Open(dir_.string());
    EXPECT_TRUE(store.ok()) << store.status();
    return ModeController::Create(std::move(*store), std::move(o));
  }
  // Options whose observers append to rollbacks_.
  ControllerOptions Observed(ControllerOptions o = {}) {
    o.on_rollback = [this](std::string_view r) { rollbacks_.emplace_back(r); };
    return o;
  }
  std::vector<std::string> AuditLines() {
    std::ifstream in(dir_ / "audit.jsonl");
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    return lines;
  }
  void WriteState(const std::string& json) {
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ / "state.json") << json;
  }
  std::vector<std::string> rollbacks_;
  static Outcome Match(Mode m) { return {OutcomeKind::kMatch, m, "", DiffStats{}}; }
  static Outcome Breach(Mode m) {
    return {OutcomeKind::kBreach, m, "rel_l2 0.5 > 0.01", DiffStats{}};
  }
  std::filesystem::path dir_;
};

TEST_F(ModeControllerTest, StartsInShadowAndPlansPerMode) {
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kShadow);
  Plan p = c->Decide("");
  EXPECT_EQ(p.served, Path::kReference);
  EXPECT_TRUE(p.run_other);  // shadow samples every call by default
  ASSERT_TRUE(c->SetMode(MC(Mode::kReference, 0, "kill switch", false, "t")).ok());
  p = c->Decide("");
  EXPECT_EQ(p.served, Path::kReference);
  EXPECT_FALSE(p.run_other);
}

TEST_F(ModeControllerTest, GateRefusesUntilWindowIsCleanAndForceOverrides) {
  ControllerOptions o;
  o.gate_window = 10;
  auto c = Make(o);
  auto st = c->SetMode(MC(Mode::kCustom, 0, "go", false, "t"));
  ASSERT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.status().message().find("0 of 10"), std::string::npos) << st.status();
  for (int i = 0; i < 9; ++i) c->Record(Match(Mode::kShadow));
  c->Record(Breach(Mode::kShadow));  // resets the run
  for (int i = 0; i < 9; ++i) c->Record(Match(Mode::kShadow));
  EXPECT_FALSE(c->Snapshot().gate.ready);
  EXPECT_FALSE(c->SetMode(MC(Mode::kCanary, 0.1, "go", false, "t")).ok());
  c->Record(Match(Mode::kShadow));
  EXPECT_TRUE(c->Snapshot().gate.ready);
  EXPECT_TRUE(c->SetMode(MC(Mode::kCanary, 0.1, "go", false, "t")).ok());

  auto d = Make(o);  // a restart under the same build keeps the mode and the gate's evidence
  EXPECT_EQ(d->mode(), Mode::kCanary);
  EXPECT_TRUE(d->Snapshot().gate.ready);
  EXPECT_FALSE(d->Snapshot().gate.forced);
  d->Record(Breach(Mode::kCanary));
  auto forced = d->SetMode(MC(Mode::kCustom, 0, "hotfix", true, "oncall"));
  ASSERT_TRUE(forced.ok()) << forced.status();
  auto audit = d->RecentAudit(10);
  ASSERT_EQ(audit.size(), 2u);
  EXPECT_TRUE(audit[1].forced);
  EXPECT_EQ(audit[1].who, "oncall");
  EXPECT_EQ(audit[1].reason, "hotfix");
  EXPECT_EQ(audit[1].from, Mode::kCanary);
  EXPECT_EQ(audit[1].to, Mode::kCustom);
}

TEST_F(ModeControllerTest, RejectsBadChanges) {
  auto c = Make();
  EXPECT_EQ(c->SetMode(MC(Mode::kShadow, 0, "", false, "t")).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (double f : {-0.5, 1.5}) {
    auto st = c->SetMode(MC(Mode::kCanary, f, "x", true, "t"));
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.status().message().find("canary_fraction"), std::string::npos);
  }
  EXPECT_EQ(c->SetSampleRate(Mode::kShadow, 2.0, "t").code(), absl::StatusCode::kInvalidArgument);
}

// A custom rate of 0 needs --force in every mode; outside custom mode the refusal says that
// nothing is served unchecked now, only once custom is served.
TEST_F(ModeControllerTest, ACustomRateOfZeroInShadowIsRefusedForWhatItWouldDoInCustom) {
  auto c = Make();
  SampleRateChange zero;
  zero.mode = Mode::kCustom;
  zero.rate = 0;
  zero.who = "t";
  zero.reason = "too slow";
  absl::Status st = c->SetSampleRate(zero);
  ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("the mode is shadow, so nothing changes now"), std::string::npos)
      << st;
  EXPECT_EQ(st.message().find("while custom is served"), std::string::npos) << st;
  EXPECT_NE(st.message().find("--force"), std::string::npos) << st;
  zero.force = true;
  EXPECT_TRUE(c->SetSampleRate(zero).ok());
  EXPECT_EQ(c->Snapshot().state.custom_sample_rate, 0);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "x", true, "t")).ok());
  zero.force = false;
  zero.rate = 0.5;
  ASSERT_TRUE(c->SetSampleRate(zero).ok());
  zero.rate = 0;
  st = c->SetSampleRate(zero);
  ASSERT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("while custom is served"), std::string::npos) << st;
}

TEST_F(ModeControllerTest, CanaryWithoutAFractionServesThePersistedOne) {
  auto c = Make();
  auto st = c->SetMode(MC(Mode::kCanary, 0, "default", true, "t"));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->canary_fraction, 0.05);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.3, "more", true, "t")).ok());
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "back", false, "t")).ok());
  st = c->SetMode(MC(Mode::kCanary, 0, "again", true, "t"));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->canary_fraction, 0.3);
}

TEST_F(ModeControllerTest, TheKillSwitchEmptiesTheGate) {
  ControllerOptions o;
  o.gate_window = 2;
  auto c = Make(o);
  c->Record(Match(Mode::kShadow));
  c->Record(Match(Mode::kShadow));
  ASSERT_TRUE(c->Snapshot().gate.ready);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", false, "t")).ok());
  ASSERT_TRUE(c->SetMode(MC(Mode::kReference, 0, "pager fired", false, "t")).ok());
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "look again", false, "t")).ok());
  const GateStatus g = c->Snapshot().gate;
  EXPECT_FALSE(g.ready);
  EXPECT_EQ(g.clean, 0);
  EXPECT_NE(g.last_breach.find("kill switch"), std::string::npos) << g.last_breach;
  auto refused = c->SetMode(MC(Mode::kCustom, 0, "again", false, "t"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  c->Record(Match(Mode::kShadow));
  c->Record(Match(Mode::kShadow));
  EXPECT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "clean again", false, "t")).ok());
}

TEST_F(ModeControllerTest, ComparisonsAreCountedSinceTheModeChanged) {
  auto c = Make();
  c->Record(Match(Mode::kShadow));
  c->Record(Match(Mode::kShadow));
  EXPECT_EQ(c->Snapshot().compared_since_mode_change, 2);
  EXPECT_TRUE(c->Snapshot().mode_since.empty());
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.5, "go", true, "t")).ok());
  EXPECT_EQ(c->Snapshot().compared_since_mode_change, 0);
  EXPECT_FALSE(c->Snapshot().mode_since.empty());
  c->Record(Match(Mode::kCanary));
  EXPECT_EQ(c->Snapshot().compared_since_mode_change, 1);
}

TEST_F(ModeControllerTest, CanaryServesTheFractionAndIsStablePerRequestId) {
  auto c = Make();
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.2, "canary", true, "t")).ok());
  int custom = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i)
    custom += c->Decide("req-" + std::to_string(i)).served == Path::kCustom;
  // Binomial(20000, 0.2): sd = 57; 5 sd either way.
  EXPECT_NEAR(custom, 0.2 * n, 5 * 57);
  for (int i = 0; i < 100; ++i) {
    const std::string id = "stable-" + std::to_string(i);
    const Path first = c->Decide(id).served;
    for (int k = 0; k < 5; ++k) EXPECT_EQ(c->Decide(id).served, first);
  }
  // Every canary call is also checked against the reference.
  for (int i = 0; i < 200; ++i) {
    Plan p = c->Decide("x" + std::to_string(i));
    if (p.served == Path::kCustom) {
      EXPECT_TRUE(p.run_other);
    }
  }
  int anon = 0;  // without an id, still about the fraction
  for (int i = 0; i < n; ++i) anon += c->Decide("").served == Path::kCustom;
  EXPECT_NEAR(anon, 0.2 * n, 5 * 57);
}

TEST_F(ModeControllerTest, RollsBackAfterExactlyKBreachesInTheWindowAndStaysRolledBack) {
  ControllerOptions o;
  o.rollback_breaches = 3;
  o.rollback_window = 50;
  auto c = Make(o);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "t")).ok());
  EXPECT_FALSE(c->Record(Breach(Mode::kCustom)));
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(c->Record(Match(Mode::kCustom)));
  EXPECT_FALSE(c->Record(Breach(Mode::kCustom)));
  EXPECT_EQ(c->mode(), Mode::kCustom);
  auto rb = c->Record({OutcomeKind::kError, Mode::kCustom, "boom", std::nullopt});
  ASSERT_TRUE(rb.has_value());
  EXPECT_EQ(*rb, "error");
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(c->Snapshot().rollbacks, 1);
  EXPECT_NE(c->Snapshot().last_rollback_reason.find("3 breaches"), std::string::npos);

  auto d = Make(o);
  EXPECT_EQ(d->mode(), Mode::kShadow);
  auto audit = d->RecentAudit(10);
  ASSERT_FALSE(audit.empty());
  EXPECT_EQ(audit.back().who, "verifyd");
  EXPECT_NE(audit.back().reason.find("auto-rollback"), std::string::npos);
}

TEST_F(ModeControllerTest, BreachesOutsideTheWindowDoNotRollBack) {
  ControllerOptions o;
  o.rollback_breaches = 3;
  o.rollback_window = 10;
  auto c = Make(o);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.5, "go", true, "t")).ok());
  for (int round = 0; round < 5; ++round) {
    EXPECT_FALSE(c->Record(Breach(Mode::kCanary)));
    EXPECT_FALSE(c->Record(Breach(Mode::kCanary)));
    for (int i = 0; i < 9; ++i) EXPECT_FALSE(c->Record(Match(Mode::kCanary)));
  }
  EXPECT_EQ(c->mode(), Mode::kCanary);
  // Breaches seen in shadow never roll a later custom mode back.
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "back", false, "t")).ok());
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(c->Record(Breach(Mode::kShadow)));
}

TEST_F(ModeControllerTest, ACrashWhileWritingStateLeavesTheOldState) {
  {
    auto c = Make();
    ASSERT_TRUE(c->SetMode(MC(Mode::kReference, 0, "kill", false, "t")).ok());
  }
  // A crash between writing the temp file and the rename leaves a half-written temp file and a
  // torn audit line.
  std::ofstream(dir_ / "state.json.tmp") << "{\"mode\": \"cus";
  std::ofstream(dir_ / "audit.jsonl", std::ios::app) << "{\"time\": \"2026";
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kReference);
  EXPECT_EQ(c->RecentAudit(10).size(), 1u);
}

// A refused use of another peer's region goes to the audit file, once a minute per caller and
// object; the recent changes (verifyctl status) stay the mode's.
TEST_F(ModeControllerTest, DenialsAreAuditedOnceAMinuteAndKeptOutOfTheRecentChanges) {
  auto c = Make();
  ASSERT_TRUE(c->SetMode(MC(Mode::kReference, 0, "flip", false, "t")).ok());
  for (int i = 0; i < 5; ++i) c->AuditDenial("uid 65534 pid 7", "use region 'pool' of uid 0");
  c->AuditDenial("uid 65534 pid 7", "close channel 'a' of uid 0");
  c->AuditDenial("uid 65533 pid 8", "use region 'pool' of uid 0");
  std::ifstream in(dir_ / "audit.jsonl");
  std::string line;
  int denied = 0;
  while (std::getline(in, line)) {
    if (line.find("\"action\":\"denied\"") != std::string::npos) ++denied;
  }
  EXPECT_EQ(denied, 3);
  const std::vector<AuditEntry> recent = c->RecentAudit(10);
  ASSERT_EQ(recent.size(), 1u);
  EXPECT_EQ(recent[0].reason, "flip");
  EXPECT_EQ(c->mode(), Mode::kReference);
}

TEST_F(ModeControllerTest, AnUnreadableStateFileRefusesToStart) {
  std::filesystem::create_directories(dir_);
  std::ofstream(dir_ / "state.json") << "not json";
  auto store = StateStore::Open(dir_.string());
  ASSERT_TRUE(store.ok());
  auto c = ModeController::Create(std::move(*store), {});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(c.status().message().find("state.json"), std::string::npos);
}

TEST_F(ModeControllerTest, ARecordedCustomFaultRestartsInShadow) {
  {
    auto c = Make();
    ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "t")).ok());
    ASSERT_TRUE(c->MarkCustomFaulted("illegal address").ok());
    EXPECT_EQ(c->mode(), Mode::kShadow);
  }
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kShadow);
  auto st = c->SetMode(MC(Mode::kCustom, 0, "again", false, "t"));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.status().message().find("faulted"), std::string::npos);
}

// Every mode change the daemon makes by itself is counted through the observer, whoever calls
// Record: the served path's fallback records an error outcome and counts on nothing else.
TEST_F(ModeControllerTest, AnErrorOutcomeInCustomModeIsCountedAsARollbackWithReasonError) {
  ControllerOptions o;
  o.rollback_breaches = 3;
  o.rollback_window = 50;
  auto c = Make(Observed(o));
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "t")).ok());
  for (int i = 0; i < 3; ++i)
    c->Record({OutcomeKind::kError, Mode::kCustom, "custom path: boom", std::nullopt});
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_, std::vector<std::string>{"error"});
  for (int i = 0; i < 3; ++i) c->Record({OutcomeKind::kError, Mode::kShadow, "boom", std::nullopt});
  EXPECT_EQ(rollbacks_.size(), 1u);  // errors seen in shadow roll nothing back
  const AuditEntry last = c->RecentAudit(1).at(0);
  EXPECT_EQ(last.origin, AuditOrigin::kDaemon);
  EXPECT_EQ(last.who, "verifyd");
  EXPECT_EQ(last.to, Mode::kShadow);
}

TEST_F(ModeControllerTest, OracleDriftClosesTheGateInShadowWithoutAnyBreachingCall) {
  ControllerOptions o;
  o.gate_window = 5;
  std::vector<std::pair<double, bool>> readings;
  o.on_drift = [&](const DriftReading& r, bool b) { readings.emplace_back(r.ratio, b); };
  auto c = Make(Observed(o));
  for (int i = 0; i < 10; ++i) c->Record(Match(Mode::kShadow));
  ASSERT_TRUE(c->Snapshot().gate.ready);
  // Clean oracle samples (custom ~1.05x the reference's error) change nothing.
  for (int i = 0; i < 40; ++i) EXPECT_FALSE(c->RecordOracle(1.75e-3, 1.66e-3));
  EXPECT_TRUE(c->Snapshot().gate.ready);
  EXPECT_EQ(c->Snapshot().drift.breaches, 0);
  // Custom twice as far from the oracle: in breach before those fill the window that held the
  // 40 clean samples (with an empty window it takes min_samples: test_drift_test).
  const int64_t window = DriftOptions{}.window;
  int first = -1;
  for (int i = 1; i <= 64 && first < 0; ++i) {
    c->RecordOracle(3.4e-3, 1.66e-3);
    if (c->Snapshot().drift.reading.breach) first = i;
  }
  EXPECT_GT(first, 0);
  EXPECT_LE(first, window / 2 + 8);
  const ControllerSnapshot s = c->Snapshot();
  EXPECT_EQ(s.drift.breaches, 1);
  EXPECT_FALSE(s.gate.ready);
  EXPECT_EQ(s.gate.clean, 0);
  EXPECT_NE(s.gate.reason.find("oracle drift"), std::string::npos) << s.gate.reason;
  EXPECT_NE(s.gate.last_breach.find("drift: "), std::string::npos) << s.gate.last_breach;
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_TRUE(rollbacks_.empty());  // nothing to roll back in shadow
  ASSERT_FALSE(readings.empty());
  EXPECT_TRUE(readings.back().first > 1.35);
  // Clean calls cannot reopen the gate while the drift test is in breach.
  for (int i = 0; i < 10; ++i) c->Record(Match(Mode::kShadow));
  EXPECT_FALSE(c->Snapshot().gate.ready);
  EXPECT_FALSE(c->SetMode(MC(Mode::kCustom, 0, "go", false, "t")).ok());
}

TEST_F(ModeControllerTest, OracleDriftRollsBackFromCustomWithReasonDrift) {
  ControllerOptions o;
  o.gate_window = 3;
  auto c = Make(Observed(o));
  for (int i = 0; i < 3; ++i) c->Record(Match(Mode::kShadow));
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", false, "t")).ok());
  std::optional<std::string> label;
  for (int i = 0; i < 64 && !label; ++i) {
    c->Record(Match(Mode::kCustom));  // every call within tolerance
    label = c->RecordOracle(3.4e-3, 1.66e-3);
  }
  EXPECT_EQ(label, "drift");
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_, std::vector<std::string>{"drift"});
  const ControllerSnapshot s = c->Snapshot();
  EXPECT_EQ(s.rollbacks, 1);
  EXPECT_NE(s.last_rollback_reason.find("drift: auto-rollback: oracle drift"), std::string::npos)
      << s.last_rollback_reason;
  const AuditEntry last = c->RecentAudit(1).at(0);
  EXPECT_EQ(last.origin, AuditOrigin::kDaemon);
  EXPECT_EQ(last.to, Mode::kShadow);
  // A forced flip back while still drifting rolls back at the next oracle sample.
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.5, "anyway", true, "t")).ok());
  EXPECT_EQ(c->RecordOracle(3.4e-3, 1.66e-3), "drift");
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_.size(), 2u);
  EXPECT_EQ(c->Snapshot().drift.breaches, 1);  // one episode, still in breach
}

TEST_F(ModeControllerTest, TheGateNeedsAPassingProbeSuiteWhenRequired) {
  ControllerOptions o;
  o.gate_window = 2;
  o.require_probe = true;
  auto c = Make(Observed(o));
  for (int i = 0; i < 5; ++i) c->Record(Match(Mode::kShadow));
  GateStatus g = c->Snapshot().gate;
  EXPECT_FALSE(g.ready);
  EXPECT_NE(g.reason.find("the probe suite has not passed yet"), std::string::npos) << g.reason;
  EXPECT_FALSE(c->RecordProbe(true, "22 of 22 probes passed"));
  EXPECT_TRUE(c->Snapshot().gate.ready);
  // A failure is a breach: the streak resets, and the gate stays closed until a pass.
  EXPECT_FALSE(c->RecordProbe(false, "1 of 22 probes failed (prefix/0: rel_l2 0.5 > 0.01)"));
  g = c->Snapshot().gate;
  EXPECT_FALSE(g.ready);
  EXPECT_EQ(g.clean, 0);
  EXPECT_NE(g.reason.find("the probe suite failed: 1 of 22"), std::string::npos) << g.reason;
  EXPECT_NE(g.last_breach.find("probe: 1 of 22"), std::string::npos) << g.last_breach;
  for (int i = 0; i < 5; ++i) c->Record(Match(Mode::kShadow));
  EXPECT_FALSE(c->Snapshot().gate.ready);
  auto refused = c->SetMode(MC(Mode::kCustom, 0, "go", false, "t"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(rollbacks_.empty());
  c->RecordProbe(true, "ok");
  EXPECT_TRUE(c->Snapshot().gate.ready);
}

TEST_F(ModeControllerTest, AFailedProbeRollsBackFromCanaryWithReasonProbe) {
  auto c = Make(Observed());
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.5, "go", true, "t")).ok());
  EXPECT_EQ(c->RecordProbe(false, "1 of 22 probes failed"), "probe");
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_, std::vector<std::string>{"probe"});
  EXPECT_NE(c->Snapshot().last_rollback_reason.find("probe: auto-rollback: probe suite: 1 of 22"),
            std::string::npos);
  // Without require_probe a pass or a failure in shadow changes no mode.
  EXPECT_FALSE(c->RecordProbe(false, "again"));
  EXPECT_EQ(rollbacks_.size(), 1u);
}

TEST_F(ModeControllerTest, AFaultAndARestartAfterItAreCountedWithReasonCustomFault) {
  {
    auto c = Make(Observed());
    ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.5, "go", true, "t")).ok());
    ASSERT_TRUE(c->MarkCustomFaulted("illegal address").ok());
    ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "anyway", true, "t")).ok());
  }
  auto c = Make(Observed());
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_, (std::vector<std::string>{"custom_fault", "custom_fault"}));
  EXPECT_EQ(c->Snapshot().rollbacks, 1);
}

TEST_F(ModeControllerTest, ARestartUnderTheSameBuildKeepsTheModeAndTheGatesEvidence) {
  ControllerOptions o;
  o.gate_window = 10;
  o.build = {"1.2.0", "abc1234", "cfg1"};
  o.evidence_save_interval = absl::Hours(1);
  {
    auto c = Make(o);
    for (int i = 0; i < 12; ++i) c->Record(Match(Mode::kShadow));
    ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "gate passed", false, "t")).ok());
    for (int i = 0; i < 5; ++i) c->Record(Match(Mode::kCustom));
    ASSERT_TRUE(c->Flush().ok());
  }
  auto c = Make(o);
  const ControllerSnapshot s = c->Snapshot();
  EXPECT_EQ(s.state.mode, Mode::kCustom);
  EXPECT_EQ(s.gate.clean, 17);
  EXPECT_TRUE(s.gate.ready);
  EXPECT_FALSE(s.gate.forced);
  EXPECT_EQ(s.state.build, o.build);
  const AuditEntry flip = c->RecentAudit(1).at(0);
  EXPECT_EQ(flip.build, o.build);  // the build the flip was approved under
}

TEST_F(ModeControllerTest, TheEvidenceIsSavedWhenTheGateOpensAndWhenABreachResetsIt) {
  ControllerOptions o;
  o.gate_window = 10;
  o.evidence_save_interval = absl::Hours(1);  // no periodic save within the test
  {
    auto c = Make(o);
    for (int i = 0; i < 10; ++i) c->Record(Match(Mode::kShadow));  // the gate opens: saved
    for (int i = 0; i < 3; ++i) c->Record(Match(Mode::kShadow));   // not saved (a crash)
  }
  {
    auto c = Make(o);
    EXPECT_EQ(c->Snapshot().gate.clean, 10);
    EXPECT_TRUE(c->Snapshot().gate.ready);
    c->Record(Breach(Mode::kShadow));  // closes the gate: saved at once
    for (int i = 0; i < 2; ++i) c->Record(Match(Mode::kShadow));
  }
  {
    auto c = Make(o);
    EXPECT_EQ(c->Snapshot().gate.clean, 0);
    EXPECT_FALSE(c->Snapshot().gate.ready);
    EXPECT_NE(c->Snapshot().gate.last_breach.find("rel_l2 0.5"), std::string::npos);
    for (int i = 0; i < 4; ++i) c->Record(Match(Mode::kShadow));
    c->Record(Breach(Mode::kShadow));  // a reset below the gate is saved at once too
  }
  EXPECT_EQ(Make(o)->Snapshot().gate.clean, 0);
  o.evidence_save_interval = absl::ZeroDuration();
  {
    auto c = Make(o);
    for (int i = 0; i < 4; ++i) c->Record(Match(Mode::kShadow));
  }
  EXPECT_EQ(Make(o)->Snapshot().gate.clean, 4);
}

TEST_F(ModeControllerTest, ARestartUnderAnotherBuildComesBackInShadowAndNeedsTheGateAgain) {
  ControllerOptions a;
  a.gate_window = 5;
  a.build = {"1.2.0", "abc1234", "cfg1"};
  {
    auto c = Make(a);
    for (int i = 0; i < 5; ++i) c->Record(Match(Mode::kShadow));
    ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.3, "gate passed", false, "t")).ok());
  }
  ControllerOptions b = a;
  b.build.commit = "def5678";
  auto c = Make(Observed(b));
  const ControllerSnapshot s = c->Snapshot();
  EXPECT_EQ(s.state.mode, Mode::kShadow);
  EXPECT_EQ(s.gate.clean, 0);
  EXPECT_EQ(s.state.build, b.build);
  EXPECT_EQ(rollbacks_, std::vector<std::string>{"build_changed"});
  const AuditEntry e = c->RecentAudit(1).at(0);
  EXPECT_EQ(e.origin, AuditOrigin::kDaemon);
  EXPECT_EQ(e.who, "verifyd");
  EXPECT_EQ(e.from, Mode::kCanary);
  EXPECT_EQ(e.to, Mode::kShadow);
  EXPECT_NE(e.reason.find("def5678"), std::string::npos) << e.reason;
  EXPECT_NE(e.reason.find("abc1234"), std::string::npos) << e.reason;
  auto refused = c->SetMode(MC(Mode::kCanary, 0.3, "again", false, "t"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.3, "again", true, "t")).ok());
  EXPECT_TRUE(c->Snapshot().gate.forced);
}

TEST_F(ModeControllerTest, ARestartUnderAnotherBuildInShadowResetsOnlyTheEvidence) {
  ControllerOptions a;
  a.gate_window = 5;
  a.build = {"1.2.0", "abc1234", "cfg1"};
  {
    auto c = Make(a);
    for (int i = 0; i < 5; ++i) c->Record(Match(Mode::kShadow));
  }
  ControllerOptions b = a;
  b.build.custom_config_hash = "cfg2";
  auto c = Make(Observed(b));
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_FALSE(c->Snapshot().gate.ready);
  EXPECT_TRUE(rollbacks_.empty());
  EXPECT_EQ(Make(b)->Snapshot().state.build, b.build);  // the new build is on disk
}

TEST_F(ModeControllerTest, AStateWithoutARecordedBuildDoesNotKeepCustom) {
  WriteState(R"({"mode": "custom", "canary_fraction": 0.05})");
  ControllerOptions o;
  o.build = {"1.2.0", "abc1234", "cfg1"};
  auto c = Make(Observed(o));
  EXPECT_EQ(c->mode(), Mode::kShadow);
  EXPECT_EQ(rollbacks_, std::vector<std::string>{"build_changed"});
  EXPECT_NE(c->RecentAudit(1).at(0).reason.find("an unrecorded build"), std::string::npos);
}

TEST_F(ModeControllerTest, AForcedFlipIsTellableFromARestoredOneAndSurvivesARestart) {
  ControllerOptions o;
  o.gate_window = 3;
  {
    auto c = Make(o);
    ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "hotfix", true, "oncall")).ok());
    EXPECT_TRUE(c->Snapshot().gate.forced);
  }
  auto c = Make(o);
  EXPECT_EQ(c->mode(), Mode::kCustom);
  EXPECT_TRUE(c->Snapshot().gate.forced);
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "back", false, "t")).ok());
  EXPECT_FALSE(c->Snapshot().gate.forced);
  for (int i = 0; i < 3; ++i) c->Record(Match(Mode::kShadow));
  // --force with the gate open is not a forced flip past the gate.
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "t")).ok());
  EXPECT_FALSE(c->Snapshot().gate.forced);
}

TEST_F(ModeControllerTest, AStateFileThatCannotBeReadRefusesToStart) {
  std::filesystem::create_directories(dir_ / "state.json");  // EISDIR, for root too
  auto c = TryMake();
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("state.json"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("directory"), std::string::npos) << c.status();
}

TEST_F(ModeControllerTest, AStateFileThatCannotBeOpenedRefusesToStart) {
  std::filesystem::create_directories(dir_);
  std::filesystem::create_symlink("state.json", dir_ / "state.json");  // ELOOP, for root too
  auto c = TryMake();
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("state.json cannot be opened"), std::string::npos)
      << c.status();
}

TEST_F(ModeControllerTest, AStateFileWithoutReadPermissionRefusesToStart) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads a mode-000 file";
  WriteState(R"({"mode": "custom"})");
  std::filesystem::permissions(dir_ / "state.json", std::filesystem::perms::none);
  auto c = TryMake();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  EXPECT_NE(c.status().message().find("state.json"), std::string::npos) << c.status();
}

TEST_F(ModeControllerTest, OutOfRangeStateValuesRefuseToStartNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"mode":"canary","canary_fraction":7,"shadow_sample_rate":-3,"custom_sample_rate":42})",
       "canary_fraction"},
      {R"({"mode":"canary","canary_fraction":0})", "canary_fraction"},
      {R"({"mode":"shadow","shadow_sample_rate":-3})", "shadow_sample_rate"},
      {R"({"mode":"shadow","custom_sample_rate":42})", "custom_sample_rate"},
      {R"({"mode":"shadow","custom_sample_rate":"0.5"})", "custom_sample_rate"},
      {R"({"mode":"shadow","gate":{"clean":-1}})", "gate.clean"},
      {R"({"mode":"sideways"})", "mode"},
  };
  for (const auto& [json, field] : cases) {
    WriteState(json);
    auto c = TryMake();
    ASSERT_FALSE(c.ok()) << json;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << json;
    EXPECT_NE(c.status().message().find(std::string(field) + ":"), std::string::npos)
        << json << " -> " << c.status();
  }
}

TEST_F(ModeControllerTest, ACustomSampleRateOfZeroNeedsForceAndIsAuditedAsForced) {
  auto c = Make(ControllerOptions());
  SampleRateChange off;
  off.mode = Mode::kCustom;
  off.rate = 0;
  off.who = "alice";
  off.reason = "too slow";
  const double before = c->Snapshot().state.custom_sample_rate;
  const absl::Status refused = c->SetSampleRate(off);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("--force"), std::string::npos) << refused;
  EXPECT_EQ(c->Snapshot().state.custom_sample_rate, before);

  off.force = true;
  ASSERT_TRUE(c->SetSampleRate(off).ok());
  EXPECT_EQ(c->Snapshot().state.custom_sample_rate, 0);
  const AuditEntry e = c->RecentAudit(1).at(0);
  EXPECT_EQ(e.action, AuditAction::kSampleRate);
  EXPECT_TRUE(e.forced);
  EXPECT_EQ(e.reason, "too slow");
  // Any other rate needs no force.
  SampleRateChange low = off;
  low.force = false;
  low.rate = 0.001;
  EXPECT_TRUE(c->SetSampleRate(low).ok());
}

TEST_F(ModeControllerTest, SamplingChangesAreAuditedAndDaemonEntriesCannotBeForged) {
  ControllerOptions o;
  o.rollback_breaches = 1;
  auto c = Make(o);
  ASSERT_TRUE(c->SetSampleRate(Mode::kShadow, 0, "alice").ok());
  AuditEntry e = c->RecentAudit(1).at(0);
  EXPECT_EQ(e.action, AuditAction::kSampleRate);
  EXPECT_EQ(e.origin, AuditOrigin::kClient);
  EXPECT_EQ(e.who, "alice");
  EXPECT_EQ(e.sample_mode, Mode::kShadow);
  EXPECT_EQ(e.sample_rate, 0);
  EXPECT_EQ(e.previous_sample_rate, 1);

  // A client that calls itself verifyd is still a client.
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "verifyd")).ok());
  e = c->RecentAudit(1).at(0);
  EXPECT_EQ(e.origin, AuditOrigin::kClient);
  EXPECT_EQ(e.who, "verifyd");
  c->Record(Breach(Mode::kCustom));
  EXPECT_EQ(c->RecentAudit(1).at(0).origin, AuditOrigin::kDaemon);

  // A start-up flag is the daemon's own change, audited only when it changes the rate.
  const size_t n = c->RecentAudit(100).size();
  ASSERT_TRUE(c->ApplySampleRateFlag(Mode::kShadow, 0).ok());
  EXPECT_EQ(c->RecentAudit(100).size(), n);
  ASSERT_TRUE(c->ApplySampleRateFlag(Mode::kCustom, 0.5).ok());
  e = c->RecentAudit(1).at(0);
  EXPECT_EQ(e.origin, AuditOrigin::kDaemon);
  EXPECT_EQ(e.who, "flag");
  EXPECT_EQ(e.sample_mode, Mode::kCustom);
  EXPECT_EQ(c->Snapshot().state.custom_sample_rate, 0.5);
  EXPECT_EQ(c->SetSampleRate(Mode::kCustom, std::nan(""), "t").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModeControllerTest, MalformedAuditLinesAreSkippedAndCounted) {
  auto c = Make();
  ASSERT_TRUE(c->SetMode(MC(Mode::kReference, 0, "first", false, "t")).ok());
  {
    std::ofstream out(dir_ / "audit.jsonl", std::ios::app);
    out << R"({"to":5})"
        << "\n"
        << "not json\n"
        << R"({"forced":"yes","who":"x"})"
        << "\n";
    out << R"({"time":"t","from":"shadow","to":"torn)";  // a crash mid-append: no newline
  }
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "second", false, "t")).ok());
  const std::vector<AuditEntry> a = c->RecentAudit(10);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].reason, "first");
  EXPECT_EQ(a[1].reason, "second");  // not glued onto the torn line
  EXPECT_EQ(c->MalformedAuditLines(), 4);
  EXPECT_EQ(c->Snapshot().audit_malformed_lines, 4);
}

TEST_F(ModeControllerTest, TheAuditRecordsTheCanaryFractionOnlyForCanary) {
  auto c = Make();
  ASSERT_TRUE(c->SetMode(MC(Mode::kCustom, 0, "go", true, "t")).ok());
  ASSERT_TRUE(c->SetMode(MC(Mode::kCanary, 0.3, "go", true, "t")).ok());
  ASSERT_TRUE(c->SetMode(MC(Mode::kShadow, 0, "back", false, "t")).ok());
  const std::vector<AuditEntry> a = c->RecentAudit(10);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[0].canary_fraction, 0);
  EXPECT_EQ(a[1].canary_fraction, 0.3);
  EXPECT_EQ(a[2].canary_fraction, 0);
  const std::vector<std::string> lines = AuditLines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].find("canary_fraction"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("\"canary_fraction\":0.3"), std::string::npos) << lines[1];
}

TEST_F(ModeControllerTest, TheLogSaysWhetherAModeWasRestored) {
  std::ostringstream log;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
  Make();
  const std::string first = log.str();
  Make()->SetMode(MC(Mode::kReference, 0, "x", false, "t")).IgnoreError();
  log.str("");
  Make();
  const std::string second = log.str();
  spdlog::set_default_logger(previous);
  EXPECT_NE(first.find("no state file"), std::string::npos) << first;
  EXPECT_EQ(first.find("restored"), std::string::npos) << first;
  EXPECT_NE(second.find("mode restored"), std::string::npos) << second;
  EXPECT_NE(second.find("reference"), std::string::npos) << second;
}

}  // namespace
}  // namespace verifyd
