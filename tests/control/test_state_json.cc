// The JSON of state.json and audit.jsonl lines: ParseState / ParseAuditLine, the pure functions
// the controller loads through (and the fuzz targets call).

#include "gtest/gtest.h"
#include "src/control/state_store.h"

namespace verifyd {
namespace {

void ExpectFieldError(const absl::Status& st, const std::string& field) {
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(field + ":"), std::string::npos) << st;
}

TEST(StateJsonTest, AStateRoundTrips) {
  PersistedState s;
  s.mode = Mode::kCanary;
  s.canary_fraction = 0.25;
  s.shadow_sample_rate = 0.5;
  s.custom_sample_rate = 0;
  s.custom_faulted = true;
  s.custom_fault_reason = "illegal address";
  s.build = {"1.2.0", "abc1234", "0123456789abcdef"};
  s.forced = true;
  s.gate = {1234, "2026-01-01T00:00:00Z breach: rel_l2"};
  absl::StatusOr<PersistedState> p = ParseState(SerializeState(s));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->mode, s.mode);
  EXPECT_EQ(p->canary_fraction, s.canary_fraction);
  EXPECT_EQ(p->shadow_sample_rate, s.shadow_sample_rate);
  EXPECT_EQ(p->custom_sample_rate, s.custom_sample_rate);
  EXPECT_EQ(p->custom_faulted, s.custom_faulted);
  EXPECT_EQ(p->custom_fault_reason, s.custom_fault_reason);
  EXPECT_EQ(p->build, s.build);
  EXPECT_EQ(p->forced, s.forced);
  EXPECT_EQ(p->gate.clean, s.gate.clean);
  EXPECT_EQ(p->gate.last_breach, s.gate.last_breach);
}

TEST(StateJsonTest, AStateFromBeforeBuildsWereRecordedStillLoads) {
  absl::StatusOr<PersistedState> p = ParseState(
      R"({"mode": "custom", "canary_fraction": 0.05, "shadow_sample_rate": 1.0,
          "custom_sample_rate": 0.01, "custom_faulted": false, "custom_fault_reason": ""})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->mode, Mode::kCustom);
  EXPECT_TRUE(p->build.empty());
  EXPECT_EQ(p->gate.clean, 0);
}

TEST(StateJsonTest, BadStatesAreRefusedNamingTheField) {
  EXPECT_FALSE(ParseState("").ok());
  EXPECT_FALSE(ParseState("[1, 2]").ok());
  ExpectFieldError(ParseState("{}").status(), "mode");
  ExpectFieldError(ParseState(R"({"mode": 3})").status(), "mode");
  ExpectFieldError(ParseState(R"({"mode": "shadow", "build": "1.2"})").status(), "build");
  ExpectFieldError(ParseState(R"({"mode": "shadow", "build": {"version": 1}})").status(),
                   "build.version");
  ExpectFieldError(ParseState(R"({"mode": "shadow", "gate": []})").status(), "gate");
  ExpectFieldError(ParseState(R"({"mode": "shadow", "gate": {"clean": 1.5}})").status(),
                   "gate.clean");
  ExpectFieldError(
      ParseState(R"({"mode": "shadow", "gate": {"clean": 18446744073709551615}})").status(),
      "gate.clean");
  ExpectFieldError(ParseState(R"({"mode": "shadow", "forced": 1})").status(), "forced");
  absl::Status overflow = ParseState(R"({"mode": "shadow", "shadow_sample_rate": 1e999})").status();
  EXPECT_NE(overflow.message().find("not valid JSON ("), std::string::npos) << overflow;
}

TEST(StateJsonTest, ValidateStateUsesTheAdminRules) {
  PersistedState s;
  EXPECT_TRUE(ValidateState(s).ok());
  s.canary_fraction = 1;
  EXPECT_TRUE(ValidateState(s).ok());
  s.canary_fraction = std::nan("");
  ExpectFieldError(ValidateState(s), "canary_fraction");
  s.canary_fraction = 0.5;
  s.custom_sample_rate = std::numeric_limits<double>::infinity();
  ExpectFieldError(ValidateState(s), "custom_sample_rate");
  EXPECT_EQ(ValidateState(s).code(), absl::StatusCode::kInvalidArgument);
}

TEST(AuditJsonTest, EntriesRoundTrip) {
  AuditEntry e;
  e.time = "2026-01-01T00:00:00Z";
  e.from = Mode::kShadow;
  e.to = Mode::kCanary;
  e.canary_fraction = 0.3;
  e.reason = "rollout";
  e.forced = true;
  e.who = "alice";
  e.origin = AuditOrigin::kClient;
  e.peer = "uid:1000";
  e.build = {"1.2.0", "abc1234", "cfg"};
  absl::StatusOr<AuditEntry> p = ParseAuditLine(SerializeAuditEntry(e));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->to, Mode::kCanary);
  EXPECT_EQ(p->canary_fraction, 0.3);
  EXPECT_EQ(p->origin, AuditOrigin::kClient);
  EXPECT_EQ(p->action, AuditAction::kMode);
  EXPECT_EQ(p->peer, "uid:1000");
  EXPECT_EQ(p->build, e.build);

  AuditEntry r;
  r.action = AuditAction::kSampleRate;
  r.origin = AuditOrigin::kDaemon;
  r.who = "flag";
  r.sample_mode = Mode::kCustom;
  r.sample_rate = 0.5;
  r.previous_sample_rate = 0.01;
  p = ParseAuditLine(SerializeAuditEntry(r));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->action, AuditAction::kSampleRate);
  EXPECT_EQ(p->origin, AuditOrigin::kDaemon);
  EXPECT_EQ(p->sample_mode, Mode::kCustom);
  EXPECT_EQ(p->sample_rate, 0.5);
  EXPECT_EQ(p->previous_sample_rate, 0.01);
}

TEST(AuditJsonTest, LinesFromBeforeOriginsWereRecordedStillRead) {
  absl::StatusOr<AuditEntry> p = ParseAuditLine(
      R"({"time":"2026-01-01T00:00:00Z","from":"shadow","to":"custom","canary_fraction":0.05,)"
      R"("reason":"go","forced":true,"who":"verifyd"})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->action, AuditAction::kMode);
  EXPECT_EQ(p->origin, AuditOrigin::kUnknown);  // a claimed "verifyd" proves nothing
  EXPECT_EQ(p->canary_fraction, 0);             // only a change to canary has a fraction
  EXPECT_EQ(p->who, "verifyd");
}

TEST(AuditJsonTest, MalformedLinesAreErrorsNamingTheField) {
  ExpectFieldError(ParseAuditLine(R"({"to":5})").status(), "to");
  ExpectFieldError(ParseAuditLine(R"({"forced":"yes"})").status(), "forced");
  ExpectFieldError(ParseAuditLine(R"({"origin":"root"})").status(), "origin");
  ExpectFieldError(ParseAuditLine(R"({"action":"delete"})").status(), "action");
  ExpectFieldError(ParseAuditLine(R"({"build":{"commit":[]}})").status(), "build.commit");
  EXPECT_FALSE(ParseAuditLine(R"({"time": "2026)").ok());
  EXPECT_FALSE(ParseAuditLine("null").ok());
}

TEST(AuditJsonTest, InvalidUtf8InAClientsNameIsReplacedNotThrown) {
  AuditEntry e;
  e.who = "al\xffice";
  const std::string line = SerializeAuditEntry(e);
  absl::StatusOr<AuditEntry> p = ParseAuditLine(line);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NE(p->who.find("al"), std::string::npos);
}

}  // namespace
}  // namespace verifyd
