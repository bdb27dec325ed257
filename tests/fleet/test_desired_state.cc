// A fleet's desired state: what parses, what is refused (naming the field), its canonical text,
// and which nodes a step holds.

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "src/fleet/desired_state.h"

namespace verifyd::fleet {
namespace {

TEST(DesiredState, AFullStateParsesAndReadsBackFromItsCanonicalText) {
  absl::StatusOr<DesiredState> s = ParseDesiredState(
      R"({"generation": 7, "mode": "canary", "canary_fraction": 0.1, "build": "0123456789ab",
          "step": {"fraction": 0.25}, "stable_mode": "reference", "reason": "r3 step 2"})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->generation, 7);
  EXPECT_EQ(s->mode, Mode::kCanary);
  EXPECT_DOUBLE_EQ(s->canary_fraction, 0.1);
  EXPECT_EQ(s->build, "0123456789ab");
  ASSERT_TRUE(s->step_fraction.has_value());
  EXPECT_DOUBLE_EQ(*s->step_fraction, 0.25);
  EXPECT_EQ(s->stable_mode, Mode::kReference);
  EXPECT_EQ(s->reason, "r3 step 2");
  const std::string text = SerializeDesiredState(*s);
  absl::StatusOr<DesiredState> again = ParseDesiredState(text);
  ASSERT_TRUE(again.ok()) << again.status() << " in " << text;
  EXPECT_EQ(SerializeDesiredState(*again), text);

  s = ParseDesiredState(R"({"generation": 1, "mode": "custom", "step": {"nodes": ["a", "b"]}})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->step_nodes, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(s->stable_mode, Mode::kShadow);
  EXPECT_TRUE(s->build.empty());
}

TEST(DesiredState, EveryBadStateIsRefusedNamingItsField) {
  const struct {
    const char* json;
    const char* field;
  } cases[] = {
      {R"({"mode": "custom"})", "generation: missing"},
      {R"({"generation": 0, "mode": "custom"})", "generation: must be an integer >= 1"},
      {R"({"generation": 1.5, "mode": "custom"})", "generation: must be an integer >= 1"},
      {R"({"generation": 1})", "mode: missing"},
      {R"({"generation": 1, "mode": "fast"})", "mode: 'fast' is not a mode"},
      {R"({"generation": 1, "mode": "canary"})", "canary_fraction: missing"},
      {R"({"generation": 1, "mode": "canary", "canary_fraction": 0})", "canary_fraction: 0"},
      {R"({"generation": 1, "mode": "canary", "canary_fraction": 1.5})", "canary_fraction: 1.5"},
      {R"({"generation": 1, "mode": "custom", "canary_fraction": 0.5})",
       "canary_fraction: given for mode custom"},
      {R"({"generation": 1, "mode": "custom", "step": {"fraction": -0.1}})", "step.fraction:"},
      {R"({"generation": 1, "mode": "custom", "step": {"fraction": 0.5, "nodes": ["a"]}})",
       "step: give 'fraction' or 'nodes', not both"},
      {R"({"generation": 1, "mode": "custom", "step": {}})", "step: give 'fraction'"},
      {R"({"generation": 1, "mode": "custom", "step": {"nodes": [""]}})", "step.nodes:"},
      {R"({"generation": 1, "mode": "custom", "step": {"percent": 5}})", "step.percent: unknown"},
      {R"({"generation": 1, "mode": "custom", "stable_mode": "canary"})",
       "stable_mode: must not serve"},
      {R"({"generation": 1, "mode": "custom", "build": 7})", "build: must be a string"},
      {R"({"generation": 1, "mode": "custom", "mdoe": "shadow"})", "mdoe: unknown field"},
      {R"({"generation": 1, "mode": "cus)", "desired state: not JSON"},
      {R"([1, 2])", "desired state: must be a JSON object"},
      {"", "desired state: not JSON"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<DesiredState> s = ParseDesiredState(c.json);
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_EQ(s.status().message().find(c.field), 0u) << c.json << " -> " << s.status();
  }
}

// The same nodes are in a step wherever it is computed, and a fraction's nodes are inside every
// larger fraction's, so a rollout that widens its step never moves a node out.
TEST(DesiredState, AStepsNodesNestAndFollowTheFraction) {
  std::vector<std::string> nodes;
  for (int i = 0; i < 2000; ++i) nodes.push_back(absl::StrCat("gpu-node-", i, ".rack", i % 7));
  DesiredState s;
  s.generation = 1;
  s.mode = Mode::kCustom;
  int previous = 0;
  for (double f : {0.0, 0.01, 0.25, 0.5, 1.0}) {
    s.step_fraction = f;
    int in = 0;
    for (const std::string& n : nodes) {
      const bool here = InStep(s, n);
      in += here;
      if (here) {
        DesiredState wider = s;
        wider.step_fraction = std::min(1.0, f * 2 + 0.01);
        EXPECT_TRUE(InStep(wider, n)) << n;
      }
      const double h = NodeHashFraction(n);
      EXPECT_GE(h, 0.0);
      EXPECT_LT(h, 1.0);
    }
    EXPECT_GE(in, previous);
    EXPECT_NEAR(in / 2000.0, f, 0.04) << "fraction " << f;
    previous = in;
  }
  EXPECT_EQ(previous, 2000);
  // The hash is FNV-1a: fixed values, the same in the controller and on every node.
  EXPECT_DOUBLE_EQ(NodeHashFraction(""), static_cast<double>(14695981039346656037ull >> 11) /
                                             static_cast<double>(uint64_t{1} << 53));
}

TEST(DesiredState, NodesOutsideTheStepGetTheStableMode) {
  absl::StatusOr<DesiredState> s = ParseDesiredState(
      R"({"generation": 3, "mode": "canary", "canary_fraction": 0.2,
          "step": {"nodes": ["n1", "n3"]}, "stable_mode": "shadow"})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(TargetFor(*s, "n1").mode, Mode::kCanary);
  EXPECT_DOUBLE_EQ(TargetFor(*s, "n1").canary_fraction, 0.2);
  EXPECT_EQ(TargetFor(*s, "n2").mode, Mode::kShadow);
  EXPECT_DOUBLE_EQ(TargetFor(*s, "n2").canary_fraction, 0);
  s->step_nodes.clear();  // no step: every node
  EXPECT_EQ(TargetFor(*s, "n2").mode, Mode::kCanary);
}

}  // namespace
}  // namespace verifyd::fleet
