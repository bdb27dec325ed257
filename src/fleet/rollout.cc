#include "src/fleet/rollout.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace verifyd::fleet {

int StepOf(const RolloutPlan& plan, const std::optional<DesiredState>& desired) {
  if (!desired || desired->mode != plan.mode || desired->build != plan.build ||
      desired->stable_mode != plan.stable_mode || !desired->step_fraction) {
    return -1;
  }
  if (plan.mode == Mode::kCanary && desired->canary_fraction != plan.canary_fraction) return -1;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    if (plan.steps[i] == *desired->step_fraction) return static_cast<int>(i);
  }
  return -1;
}

DesiredState PlanState(const RolloutPlan& plan, int index, int64_t generation,
                       const std::string& reason) {
  DesiredState s;
  s.generation = generation;
  s.stable_mode = plan.stable_mode;
  s.reason = reason;
  if (index < 0) {
    s.mode = plan.stable_mode;
    return s;
  }
  s.mode = plan.mode;
  if (plan.mode == Mode::kCanary) s.canary_fraction = plan.canary_fraction;
  s.build = plan.build;
  s.step_fraction = plan.steps[static_cast<size_t>(index)];
  return s;
}

std::string DescribeStep(const RolloutPlan& plan, int index) {
  if (index < 0) return absl::StrCat("stable (", ModeName(plan.stable_mode), ")");
  return absl::StrCat("step ", index + 1, " of ", plan.steps.size(), " (",
                      plan.steps[static_cast<size_t>(index)], ")");
}

absl::StatusOr<NodeReport> ParseNodeReport(std::string_view json) {
  nlohmann::json j =
      nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("node status: not a JSON object");
  }
  if (!j.contains("node") || !j["node"].is_string()) {
    return absl::InvalidArgumentError("node status: node: missing or not a string");
  }
  NodeReport r;
  auto str = [&j](const char* k, std::string* out) {
    if (j.contains(k) && j[k].is_string()) *out = j[k].get<std::string>();
  };
  auto num = [&j](const char* k, auto* out) {
    if (j.contains(k) && j[k].is_number()) *out = j[k].get<std::decay_t<decltype(*out)>>();
  };
  auto flag = [&j](const char* k, bool* out) {
    if (j.contains(k) && j[k].is_boolean()) *out = j[k].get<bool>();
  };
  str("node", &r.node);
  str("mode", &r.mode);
  num("canary_fraction", &r.canary_fraction);
  str("gate", &r.gate);
  str("gate_reason", &r.gate_reason);
  flag("source_up", &r.source_up);
  str("source_error", &r.source_error);
  num("generation_seen", &r.generation_seen);
  num("generation_acted", &r.generation_acted);
  flag("in_step", &r.in_step);
  str("last_outcome", &r.last_outcome);
  str("last_detail", &r.last_detail);
  str("build", &r.build);
  str("time", &r.time);
  r.raw = std::move(j);
  return r;
}

GenerationProgress ProgressOf(const DesiredState& desired, const std::vector<NodeReport>& nodes) {
  GenerationProgress p;
  for (const NodeReport& n : nodes) {
    if (InStep(desired, n.node)) ++p.in_step;
    if (n.generation_acted < desired.generation) {
      p.pending.push_back(n.node);
    } else if (n.generation_acted == desired.generation && n.last_outcome != "applied") {
      p.refused.push_back(absl::StrCat(n.node, ": ", n.last_detail));
    } else {
      ++p.applied;
    }
  }
  return p;
}

FleetTotals TotalsOf(const std::vector<NodeReport>& nodes) {
  FleetTotals t;
  for (const NodeReport& n : nodes) {
    ++t.nodes;
    ++t.modes[n.mode.empty() ? "unknown" : n.mode];
    if (n.in_step) ++t.in_step;
    if (n.last_outcome == "refused" || n.last_outcome == "other_build") ++t.refused;
    if (!n.source_up) ++t.source_down;
  }
  return t;
}

}  // namespace verifyd::fleet
