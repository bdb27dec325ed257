// The mode state machine: gate, force, canary selection, rollback, durability.

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "src/control/mode_controller.h"

namespace verifyd {
namespace {

class ModeControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("mode_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<ModeController> Make(ControllerOptions o = {}) {
    auto store = StateStore::Open(dir_.string());
    EXPECT_TRUE(store.ok()) << store.status();
    auto c = ModeController::Create(std::move(*store), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }
  static Outcome Match(Mode m) { return {OutcomeKind::kMatch, m, "", DiffStats{}}; }
  static Outcome Breach(Mode m) { return {OutcomeKind::kBreach, m, "rel_l2 0.5 > 0.01", DiffStats{}}; }
  std::filesystem::path dir_;
};

TEST_F(ModeControllerTest, StartsInShadowAndPlansPerMode) {
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kShadow);
  Plan p = c->Decide("");
  EXPECT_EQ(p.served, Path::kReference);
  EXPECT_TRUE(p.run_other);  // shadow samples every call by default
  ASSERT_TRUE(c->SetMode({Mode::kReference, 0, "kill switch", false, "t"}).ok());
  p = c->Decide("");
  EXPECT_EQ(p.served, Path::kReference);
  EXPECT_FALSE(p.run_other);
}

TEST_F(ModeControllerTest, GateRefusesUntilWindowIsCleanAndForceOverrides) {
  ControllerOptions o;
  o.gate_window = 10;
  auto c = Make(o);
  auto st = c->SetMode({Mode::kCustom, 0, "go", false, "t"});
  ASSERT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.status().message().find("0 of 10"), std::string::npos) << st.status();
  for (int i = 0; i < 9; ++i) c->Record(Match(Mode::kShadow));
  c->Record(Breach(Mode::kShadow));  // resets the run
  for (int i = 0; i < 9; ++i) c->Record(Match(Mode::kShadow));
  EXPECT_FALSE(c->Snapshot().gate.ready);
  EXPECT_FALSE(c->SetMode({Mode::kCanary, 0.1, "go", false, "t"}).ok());
  c->Record(Match(Mode::kShadow));
  EXPECT_TRUE(c->Snapshot().gate.ready);
  EXPECT_TRUE(c->SetMode({Mode::kCanary, 0.1, "go", false, "t"}).ok());

  auto d = Make(o);  // a restart forgets the gate history, never the mode
  EXPECT_EQ(d->mode(), Mode::kCanary);
  EXPECT_FALSE(d->Snapshot().gate.ready);
  auto forced = d->SetMode({Mode::kCustom, 0, "hotfix", true, "oncall"});
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
  EXPECT_EQ(c->SetMode({Mode::kShadow, 0, "", false, "t"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (double f : {0.0, -0.5, 1.5}) {
    auto st = c->SetMode({Mode::kCanary, f, "x", true, "t"});
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.status().message().find("canary_fraction"), std::string::npos);
  }
  EXPECT_EQ(c->SetSampleRate(Mode::kShadow, 2.0, "t").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModeControllerTest, CanaryServesTheFractionAndIsStablePerRequestId) {
  auto c = Make();
  ASSERT_TRUE(c->SetMode({Mode::kCanary, 0.2, "canary", true, "t"}).ok());
  int custom = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) custom += c->Decide("req-" + std::to_string(i)).served == Path::kCustom;
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
  ASSERT_TRUE(c->SetMode({Mode::kCustom, 0, "go", true, "t"}).ok());
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
  ASSERT_TRUE(c->SetMode({Mode::kCanary, 0.5, "go", true, "t"}).ok());
  for (int round = 0; round < 5; ++round) {
    EXPECT_FALSE(c->Record(Breach(Mode::kCanary)));
    EXPECT_FALSE(c->Record(Breach(Mode::kCanary)));
    for (int i = 0; i < 9; ++i) EXPECT_FALSE(c->Record(Match(Mode::kCanary)));
  }
  EXPECT_EQ(c->mode(), Mode::kCanary);
  // Breaches seen in shadow never roll a later custom mode back.
  ASSERT_TRUE(c->SetMode({Mode::kShadow, 0, "back", false, "t"}).ok());
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(c->Record(Breach(Mode::kShadow)));
}

TEST_F(ModeControllerTest, ACrashWhileWritingStateLeavesTheOldState) {
  {
    auto c = Make();
    ASSERT_TRUE(c->SetMode({Mode::kReference, 0, "kill", false, "t"}).ok());
  }
  // A crash between writing the temp file and the rename leaves a half-written temp file and a
  // torn audit line.
  std::ofstream(dir_ / "state.json.tmp") << "{\"mode\": \"cus";
  std::ofstream(dir_ / "audit.jsonl", std::ios::app) << "{\"time\": \"2026";
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kReference);
  EXPECT_EQ(c->RecentAudit(10).size(), 1u);
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
    ASSERT_TRUE(c->SetMode({Mode::kCustom, 0, "go", true, "t"}).ok());
    ASSERT_TRUE(c->MarkCustomFaulted("illegal address").ok());
    EXPECT_EQ(c->mode(), Mode::kShadow);
  }
  auto c = Make();
  EXPECT_EQ(c->mode(), Mode::kShadow);
  auto st = c->SetMode({Mode::kCustom, 0, "again", false, "t"});
  EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.status().message().find("faulted"), std::string::npos);
}

}  // namespace
}  // namespace verifyd
