#pragma once
// A rollout plan: what `verifyctl fleet` promotes, in which steps, and the analysis that
// decides each step (docs/operations.md, "Fleets"; an example in deploy/fleet/rollout.json):
//
//   {"name": "custom-v7", "mode": "custom", "build": "0123456789ab", "stable_mode": "shadow",
//    "steps": [0.125, 0.25, 1.0], "step_duration_s": 300, "analysis_interval_s": 30,
//    "settle_timeout_s": 120, "prometheus": "http://prometheus:9090",
//    "queries": [{"name": "breach_rate", "query": "...", "max": 0.001}, ...]}
//
// Step k asks the nodes whose name hashes below steps[k] (desired_state.h) for `mode`, the others
// for `stable_mode`. A step advances once every node acted on it (within settle_timeout_s) and
// every query passed at each analysis interval for step_duration_s; a query outside its bounds
// rolls the whole fleet back to stable_mode.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/control/mode.h"

namespace verifyd::fleet {

// One PromQL query of the analysis: every sample of its instant vector (or its scalar) must be
// within [min, max] (either bound may be absent, not both).
struct AnalysisQuery {
  std::string name;
  std::string query;
  std::optional<double> min, max;
};

struct RolloutPlan {
  std::string name;
  Mode mode = Mode::kCustom;   // canary or custom
  double canary_fraction = 0;  // canary only, in (0, 1]
  std::string build;           // empty: any build
  Mode stable_mode = Mode::kShadow;
  std::vector<double> steps;  // fractions of the node-name hash space, increasing, in (0, 1]
  absl::Duration step_duration = absl::ZeroDuration();
  absl::Duration analysis_interval = absl::ZeroDuration();
  absl::Duration settle_timeout = absl::Seconds(60);
  std::string prometheus;  // base URL, http://host:port; empty: give --prometheus
  std::vector<AnalysisQuery> queries;
};

// INVALID_ARGUMENT naming the field for anything else than the format above; unknown fields are
// refused.
absl::StatusOr<RolloutPlan> ParseRolloutPlan(std::string_view json);
// The canonical JSON of `p` (ParseRolloutPlan reads it back to the same plan).
std::string SerializeRolloutPlan(const RolloutPlan& p);

}  // namespace verifyd::fleet
