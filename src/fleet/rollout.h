#pragma once
// The rollout controller's view of a fleet (`verifyctl fleet`): which step of a plan the desired
// state is at, the desired state of each action (promote, undo, abort), the nodes' status keys
// (etcd_source.h writes them) and how far a generation got.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "src/fleet/desired_state.h"
#include "src/fleet/rollout_plan.h"

namespace verifyd::fleet {

// The index of the plan's step the state asks for (its mode, canary fraction, build and step
// fraction); -1 for none (no state, the stable state, or another rollout's).
int StepOf(const RolloutPlan& plan, const std::optional<DesiredState>& desired);
// Step `index` of the plan, or, for -1, the stable state: every node asked for stable_mode, for
// any build (so that a rollback reaches every node).
DesiredState PlanState(const RolloutPlan& plan, int index, int64_t generation,
                       const std::string& reason);
// "step 2 of 3 (0.25)" or "stable (shadow)".
std::string DescribeStep(const RolloutPlan& plan, int index);

// A node's status key, as the node wrote it; fields it lacks keep their defaults.
struct NodeReport {
  std::string node;
  std::string mode;
  double canary_fraction = 0;
  std::string gate;  // "open" or "closed"
  std::string gate_reason;
  bool source_up = false;
  std::string source_error;
  int64_t generation_seen = 0;
  int64_t generation_acted = 0;
  bool in_step = false;
  std::string last_outcome;  // applied, refused, other_build
  std::string last_detail;
  std::string build;
  std::string time;
  nlohmann::json raw;  // the key's JSON as read
};
// INVALID_ARGUMENT when the value is not a JSON object with a string `node`.
absl::StatusOr<NodeReport> ParseNodeReport(std::string_view json);

// How far the fleet got with one generation.
struct GenerationProgress {
  std::vector<std::string> pending;  // not acted on it yet
  std::vector<std::string> refused;  // "NODE: detail", refused it (gate, probe, build)
  int in_step = 0;                   // nodes the generation's step holds
  int applied = 0;                   // nodes that took it
};
GenerationProgress ProgressOf(const DesiredState& desired, const std::vector<NodeReport>& nodes);

// The totals `fleet status` prints.
struct FleetTotals {
  int nodes = 0;
  std::map<std::string, int> modes;
  int in_step = 0, refused = 0, source_down = 0;
};
FleetTotals TotalsOf(const std::vector<NodeReport>& nodes);

}  // namespace verifyd::fleet
