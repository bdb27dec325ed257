// The rollout plan's format: what parses, what each bad field is refused with, and the
// controller's view of a plan's steps and of the nodes' status keys (src/fleet/rollout.h).

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "src/fleet/prometheus_query.h"
#include "src/fleet/rollout.h"
#include "src/fleet/rollout_plan.h"

namespace verifyd::fleet {
namespace {

constexpr char kPlan[] =
    R"js({"name": "r7", "mode": "custom", "build": "abc", "steps": [0.125, 0.25, 1],
  "step_duration_s": 300, "analysis_interval_s": 30, "prometheus": "http://prom:9090",
  "queries": [{"name": "breach_rate", "query": "sum(x)", "max": 0.001}]})js";

std::string Error(const std::string& json) {
  absl::StatusOr<RolloutPlan> p = ParseRolloutPlan(json);
  return p.ok() ? "ok" : std::string(p.status().message());
}

std::string With(const std::string& key, const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(kPlan);
  if (value.empty()) {
    j.erase(key);
  } else {
    j[key] = nlohmann::json::parse(value);
  }
  return j.dump();
}

TEST(RolloutPlan, ParsesAndRoundTrips) {
  absl::StatusOr<RolloutPlan> p = ParseRolloutPlan(kPlan);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "r7");
  EXPECT_EQ(p->mode, Mode::kCustom);
  EXPECT_EQ(p->stable_mode, Mode::kShadow);
  EXPECT_EQ(p->steps, (std::vector<double>{0.125, 0.25, 1}));
  EXPECT_EQ(p->step_duration, absl::Seconds(300));
  EXPECT_EQ(p->settle_timeout, absl::Seconds(60));
  ASSERT_EQ(p->queries.size(), 1u);
  EXPECT_EQ(*p->queries[0].max, 0.001);
  EXPECT_FALSE(p->queries[0].min.has_value());
  absl::StatusOr<RolloutPlan> again = ParseRolloutPlan(SerializeRolloutPlan(*p));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(SerializeRolloutPlan(*again), SerializeRolloutPlan(*p));
}

TEST(RolloutPlan, TheShippedExampleParses) {
  std::ifstream in(VERIFYD_EXAMPLE_PLAN);
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<RolloutPlan> p = ParseRolloutPlan(text.str());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->queries.size(), 5u);
  EXPECT_EQ(p->steps.back(), 1.0);
}

TEST(RolloutPlan, NamesTheBadField) {
  EXPECT_EQ(Error("{"), "rollout plan: file: not JSON");
  EXPECT_EQ(Error(With("name", "")), "rollout plan: name: missing");
  EXPECT_EQ(Error(With("mode", R"("shadow")")),
            "rollout plan: mode: must serve the custom kernel (canary or custom)");
  EXPECT_EQ(Error(With("mode", R"("canary")")),
            "rollout plan: canary_fraction: missing: canary needs a fraction in (0, 1]");
  EXPECT_EQ(Error(With("canary_fraction", "0.1")),
            "rollout plan: canary_fraction: given for mode custom; only canary takes one");
  EXPECT_EQ(Error(With("stable_mode", R"("custom")")),
            "rollout plan: stable_mode: must not serve the custom kernel (reference or shadow)");
  EXPECT_EQ(Error(With("steps", "[0.5, 0.25]")),
            "rollout plan: steps[1]: 0.25 is not above the step before it (0.5): steps only "
            "widen");
  EXPECT_EQ(Error(With("steps", "[0, 1]")), "rollout plan: steps[0]: 0 is outside (0, 1]");
  EXPECT_EQ(Error(With("steps", "[]")),
            "rollout plan: steps: must be a non-empty array of fractions");
  EXPECT_EQ(Error(With("step_duration_s", "-1")),
            "rollout plan: step_duration_s: -1 is outside (0, 86400] seconds");
  EXPECT_EQ(Error(With("analysis_interval_s", "301")),
            "rollout plan: analysis_interval_s: must not be longer than step_duration_s");
  EXPECT_EQ(Error(With("analysis_interval_s", "")), "rollout plan: analysis_interval_s: missing");
  EXPECT_EQ(Error(With("prometheus", R"("prom:9090")")),
            "rollout plan: prometheus: must be a URL http://host:port");
  EXPECT_EQ(Error(With("queries", R"([{"name": "a", "query": "x"}])")),
            "rollout plan: queries[0]: give 'min', 'max' or both");
  EXPECT_EQ(Error(With("queries", R"([{"name": "a", "query": "x", "max": 1, "min": 2}])")),
            "rollout plan: queries[0]: min 2 is above max 1");
  EXPECT_EQ(Error(With("queries", R"([{"name": "a", "query": "x", "max": 1},
                                      {"name": "a", "query": "y", "max": 1}])")),
            "rollout plan: queries[1].name: 'a' is given twice");
  EXPECT_EQ(Error(With("queries", R"([{"name": "a", "query": "x", "maximum": 1}])")),
            "rollout plan: queries[0].maximum: unknown field (name, query, min, max)");
  EXPECT_EQ(Error(With("step", "1")).rfind("rollout plan: step: unknown field", 0), 0u);
}

TEST(Rollout, StepsPromoteUndoAndAbort) {
  const RolloutPlan plan = *ParseRolloutPlan(kPlan);
  EXPECT_EQ(StepOf(plan, std::nullopt), -1);
  const DesiredState first = PlanState(plan, 0, 4, "r");
  EXPECT_EQ((std::tuple(first.generation, first.mode, first.build, *first.step_fraction)),
            (std::tuple(int64_t{4}, Mode::kCustom, std::string("abc"), 0.125)));
  EXPECT_EQ(StepOf(plan, first), 0);
  EXPECT_EQ(StepOf(plan, PlanState(plan, 2, 5, "r")), 2);
  // The stable state: every node, any build (so that a rollback reaches every node).
  const DesiredState stable = PlanState(plan, -1, 6, "r");
  EXPECT_EQ(stable.mode, Mode::kShadow);
  EXPECT_TRUE(stable.build.empty());
  EXPECT_FALSE(stable.step_fraction.has_value());
  EXPECT_EQ(StepOf(plan, stable), -1);
  // Another rollout's state (another build) is at no step of this one.
  DesiredState other = first;
  other.build = "def";
  EXPECT_EQ(StepOf(plan, other), -1);
  EXPECT_EQ(DescribeStep(plan, 1), "step 2 of 3 (0.25)");
  EXPECT_EQ(DescribeStep(plan, -1), "stable (shadow)");
}

TEST(Rollout, NodeReportsProgressAndTotals) {
  EXPECT_FALSE(ParseNodeReport("{}").ok());
  EXPECT_FALSE(ParseNodeReport("[").ok());
  auto report = [](const std::string& node, const std::string& mode, int64_t acted,
                   const std::string& outcome) {
    nlohmann::json j = {{"node", node},
                        {"mode", mode},
                        {"gate", "open"},
                        {"source_up", true},
                        {"generation_acted", acted},
                        {"in_step", true},
                        {"last_outcome", outcome},
                        {"last_detail", "custom refused: gate: not ready"}};
    return *ParseNodeReport(j.dump());
  };
  const std::vector<NodeReport> nodes = {report("papa", "custom", 7, "applied"),
                                         report("golf", "shadow", 7, "refused"),
                                         report("kilo", "shadow", 6, "applied")};
  DesiredState s;
  s.generation = 7;
  s.mode = Mode::kCustom;
  s.step_fraction = 0.5;  // papa 0.337, golf 0.815, kilo 0.933
  const GenerationProgress p = ProgressOf(s, nodes);
  EXPECT_EQ(p.in_step, 1);
  EXPECT_EQ(p.applied, 1);
  EXPECT_EQ(p.pending, std::vector<std::string>{"kilo"});
  EXPECT_EQ(p.refused, std::vector<std::string>{"golf: custom refused: gate: not ready"});
  const FleetTotals t = TotalsOf(nodes);
  EXPECT_EQ((std::tuple(t.nodes, t.modes.at("custom"), t.modes.at("shadow"), t.refused)),
            (std::tuple(3, 1, 2, 1)));
}

TEST(PrometheusQuery, ParsesVectorsScalarsAndErrors) {
  auto v = ParsePromResponse(R"({"status":"success","data":{"resultType":"vector","result":[
      {"metric":{"instance":"a:1"},"value":[1.5,"0.25"]},{"metric":{},"value":[1.5,"NaN"]}]}})");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), 2u);
  EXPECT_EQ((*v)[0].labels, R"({instance="a:1"})");
  EXPECT_EQ((*v)[0].value, 0.25);
  EXPECT_TRUE(std::isnan((*v)[1].value));
  auto s = ParsePromResponse(R"({"status":"success","data":{"resultType":"scalar",
      "result":[1,"+Inf"]}})");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(std::isinf((*s)[0].value));
  auto bad =
      ParsePromResponse(R"({"status":"error","errorType":"bad_data","error":"parse error"})");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "prometheus: parse error");
  EXPECT_FALSE(ParsePromResponse("<html>").ok());
  EXPECT_FALSE(ParsePromResponse(R"({"status":"success","data":{"resultType":"matrix",
      "result":[]}})")
                   .ok());
}

TEST(PrometheusQuery, JudgesTheWorstSample) {
  AnalysisQuery q{"breach_rate", "x", std::nullopt, 0.01};
  auto samples = [](std::vector<PromSample> s) {
    return absl::StatusOr<std::vector<PromSample>>(std::move(s));
  };
  QueryVerdict ok = Judge(q, samples({{"", 0.001}}));
  EXPECT_TRUE(ok.pass);
  EXPECT_EQ(ok.detail, "breach_rate = 0.001 (max 0.01)");
  QueryVerdict bad = Judge(q, samples({{"{i=\"a\"}", 0.001}, {"{i=\"b\"}", 0.5}}));
  EXPECT_FALSE(bad.pass);
  EXPECT_EQ(bad.detail, "breach_rate = 0.5 (max 0.01) {i=\"b\"}, worst of 2 series");
  EXPECT_FALSE(Judge(q, samples({{"", std::nan("")}})).pass);
  QueryVerdict empty = Judge(q, samples({}));
  EXPECT_FALSE(empty.pass);
  EXPECT_EQ(empty.detail, "breach_rate: no data (an empty result)");
  EXPECT_FALSE(Judge(q, absl::UnavailableError("prometheus down")).pass);
  AnalysisQuery floor{"nodes_up", "x", 4.0, std::nullopt};
  EXPECT_FALSE(Judge(floor, samples({{"", 3}})).pass);
  EXPECT_TRUE(Judge(floor, samples({{"", 4}})).pass);
}

}  // namespace
}  // namespace verifyd::fleet
