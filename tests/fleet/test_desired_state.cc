// A fleet's desired state: what parses, what is refused (naming the field), its canonical text,
// and which nodes a step holds.

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
}

// The hash is fixed: the controller and every node compute the same step, and a change moves
// nodes between steps (deploy/README.md, "Fleet rollouts"). FNV-1a of the name, then fmix64.
TEST(DesiredState, TheNodeHashIsFnv1aThenFmix64) {
  auto top53 = [](uint64_t h) {
    return static_cast<double>(h >> 11) / static_cast<double>(uint64_t{1} << 53);
  };
  EXPECT_DOUBLE_EQ(NodeHashFraction(""), top53(0xefd01f60ba992926ull));
  EXPECT_DOUBLE_EQ(NodeHashFraction("node-0"), top53(0x74bd04f6e09fed6dull));
  EXPECT_DOUBLE_EQ(NodeHashFraction("node-5"), top53(0x131e17aae7eadff1ull));
  EXPECT_DOUBLE_EQ(NodeHashFraction("gpu-a-01"), top53(0x6fe2f4fc4149afb3ull));
  // node-0 ... node-7 (tests/python/test_fleet_rollout.py's fleet): one below 0.125, two
  // below 0.25.
  std::vector<std::string> below_eighth, below_quarter;
  for (int i = 0; i < 8; ++i) {
    const std::string n = absl::StrCat("node-", i);
    if (NodeHashFraction(n) < 0.125) below_eighth.push_back(n);
    if (NodeHashFraction(n) < 0.25) below_quarter.push_back(n);
  }
  EXPECT_EQ(below_eighth, (std::vector<std::string>{"node-5"}));
  EXPECT_EQ(below_quarter, (std::vector<std::string>{"node-2", "node-5"}));
}

// Names as fleets give them (a prefix, a number, a domain) differ in their last characters. A
// step of a fraction F holds each such node with probability F, as if at random: for 8 nodes at
// 25%, 0.93 nodes off 2 on average, and none in 10% of the name sets. FNV-1a alone put a set's
// nodes together (node-0 ... node-7 all above 0.5, gpu-a-01 ... gpu-a-08 all below 0.125): over
// these sets, 1.66 off on average, none in 34% and all in 8%.
TEST(DesiredState, SimilarNamesSpreadOverTheHashSpace) {
  const std::vector<std::string> prefixes = absl::StrSplit(
      "node- gpu- gpu-a- gpu-node- worker- h100- dgx trn- compute- ip-10-0-1- a100- k8s-gpu- "
      "gke-prod-pool-1- rack1-n kimi-tp32-",
      ' ');
  const char* suffixes[] = {"", ".cluster.local", ".ec2.internal"};
  for (const int nodes : {8, 64}) {
    int sets = 0, none = 0, all = 0;
    double off = 0;
    for (const std::string& prefix : prefixes) {
      for (const int width : {1, 2, 3}) {
        for (const int first : {0, 1}) {
          for (const char* suffix : suffixes) {
            int in = 0;
            for (int i = first; i < first + nodes; ++i) {
              char name[64];
              std::snprintf(name, sizeof(name), "%s%0*d%s", prefix.c_str(), width, i, suffix);
              in += NodeHashFraction(name) < 0.25;
            }
            ++sets;
            none += in == 0;
            all += in == nodes;
            off += std::abs(in - nodes / 4.0);
          }
        }
      }
    }
    SCOPED_TRACE(absl::StrCat(nodes, " nodes, ", sets, " name sets"));
    // Binomial: 0.93 off on average for 8 nodes (2.75 for 64), the step empty in 10% (0%).
    EXPECT_LE(off / sets, nodes == 8 ? 1.2 : 3.6);
    EXPECT_LE(none, nodes == 8 ? sets * 15 / 100 : 0);
    EXPECT_EQ(all, 0);
  }
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
