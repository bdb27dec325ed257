#include "src/cli/fleet_commands.h"

#include <cmath>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "fmt/format.h"
#include "src/fleet/etcd_client.h"
#include "src/fleet/rollout_controller.h"

namespace verifyd::cli {
namespace {

using fleet::DesiredState;
using fleet::RolloutController;
using fleet::RolloutPlan;

absl::StatusOr<RolloutPlan> LoadPlan(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--plan: cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<RolloutPlan> plan = fleet::ParseRolloutPlan(text.str());
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", plan.status().message()));
  }
  return plan;
}

std::string DescribeDesired(const DesiredState& s) {
  std::string out = absl::StrCat("generation ", s.generation, ": ", ModeName(s.mode));
  if (s.mode == Mode::kCanary) absl::StrAppend(&out, " ", s.canary_fraction);
  if (s.step_fraction) {
    absl::StrAppend(&out, " on the nodes below ", *s.step_fraction, " of the hash space");
  } else if (!s.step_nodes.empty()) {
    absl::StrAppend(&out, " on ", s.step_nodes.size(), " named node(s)");
  } else {
    absl::StrAppend(&out, " on every node");
  }
  absl::StrAppend(&out, ", stable ", ModeName(s.stable_mode));
  if (!s.build.empty()) absl::StrAppend(&out, ", build ", s.build);
  if (!s.reason.empty()) absl::StrAppend(&out, " (", s.reason, ")");
  return out;
}

nlohmann::json DesiredJson(const DesiredState& s) {
  return nlohmann::json::parse(fleet::SerializeDesiredState(s));
}

int Status(const GlobalOptions& g, RolloutController& c, const std::optional<RolloutPlan>& plan) {
  absl::StatusOr<fleet::FleetView> v = c.Read();
  if (!v.ok()) return Fail(g, "fleet status", std::string(v.status().message()));
  const fleet::FleetTotals t = fleet::TotalsOf(v->nodes);
  if (g.json) {
    nlohmann::json j;
    j["desired"] = v->desired ? DesiredJson(*v->desired) : nlohmann::json();
    if (!v->desired_error.empty()) j["desired_error"] = v->desired_error;
    if (plan) j["step"] = fleet::StepOf(*plan, v->desired);
    j["nodes"] = nlohmann::json::array();
    for (const fleet::NodeReport& n : v->nodes) j["nodes"].push_back(n.raw);
    j["unreadable"] = v->unreadable;
    j["totals"] = {{"nodes", t.nodes},
                   {"modes", t.modes},
                   {"in_step", t.in_step},
                   {"refused", t.refused},
                   {"source_down", t.source_down}};
    PrintJson(j);
    return 0;
  }
  std::cout << "desired     "
            << (v->desired                 ? DescribeDesired(*v->desired)
                : v->desired_error.empty() ? "none"
                                           : "invalid: " + v->desired_error)
            << "\n";
  if (plan) {
    std::cout << "rollout     " << plan->name << " at "
              << fleet::DescribeStep(*plan, fleet::StepOf(*plan, v->desired)) << "\n";
  }
  std::cout << fmt::format("{:<20} {:<9} {:<6} {:>5} {:>5} {:<5} {:<12} {:<11} {}\n", "NODE",
                           "MODE", "GATE", "SEEN", "ACTED", "STEP", "OUTCOME", "SOURCE", "DETAIL");
  for (const fleet::NodeReport& n : v->nodes) {
    const std::string mode =
        n.mode == "canary" ? absl::StrCat("canary ", n.canary_fraction) : n.mode;
    std::string detail = n.last_detail;
    if (!n.source_up && !n.source_error.empty()) {
      detail = absl::StrCat("source: ", n.source_error, detail.empty() ? "" : "; ", detail);
    }
    std::cout << fmt::format(
        "{:<20} {:<9} {:<6} {:>5} {:>5} {:<5} {:<12} {:<11} {}\n", n.node, mode, n.gate,
        n.generation_seen, n.generation_acted, n.in_step ? "in" : "out",
        n.last_outcome.empty() ? "-" : n.last_outcome, n.source_up ? "up" : "down", detail);
  }
  for (const std::string& u : v->unreadable) std::cout << "unreadable  " << u << "\n";
  std::string modes;
  for (const auto& [mode, count] : t.modes) {
    absl::StrAppend(&modes, modes.empty() ? "" : ", ", count, " ", mode);
  }
  std::cout << "totals      " << t.nodes << " nodes" << (modes.empty() ? "" : " (" + modes + ")")
            << "; " << t.in_step << " in step; " << t.refused << " refused; " << t.source_down
            << " source down\n";
  return 0;
}

int Wrote(const GlobalOptions& g, const std::string& what, const absl::StatusOr<DesiredState>& s) {
  if (!s.ok()) return Fail(g, what, std::string(s.status().message()));
  if (g.json) {
    PrintJson({{"desired", DesiredJson(*s)}});
  } else {
    std::cout << "desired     " << DescribeDesired(*s) << "\n";
  }
  return 0;
}

}  // namespace

CLI::App* AddFleetCommands(CLI::App* app, FleetOptions* o) {
  CLI::App* fleet = app->add_subcommand(
      "fleet", "the fleet's rollout controller: its desired state and its nodes in etcd");
  fleet->require_subcommand(1);
  fleet->add_option("--etcd", o->etcd, "etcd endpoints, host:port[,host:port...]")
      ->envname("VERIFYD_FLEET_ETCD")
      ->required();
  fleet->add_option("--prefix", o->prefix, "the fleet's key prefix (verifyd's --fleet_etcd_prefix)")
      ->capture_default_str();
  fleet->add_option("--plan", o->plan_file, "the rollout plan, a JSON file");
  fleet->add_subcommand("status", "the desired state, one line per node, and totals");
  fleet->add_subcommand("promote", "the plan's next step (--plan)");
  fleet->add_subcommand("undo", "the plan's step before the current one (--plan)");
  CLI::App* abort = fleet->add_subcommand(
      "abort", "every node to the stable mode (the plan's, else the desired state's)");
  abort->add_option("--reason", o->reason, "why (in every node's audit)")->capture_default_str();
  CLI::App* run = fleet->add_subcommand(
      "run",
      "run the plan from its current step to the last, each step gated by its analysis (exit 3: "
      "held, 4: rolled back, 5: etcd lost past --etcd_lost_timeout)");
  run->add_option("--prometheus", o->prometheus, "http://host:port, in place of the plan's");
  run->add_option("--etcd_lost_timeout", o->etcd_lost_timeout_s,
                  "seconds to wait for a lost etcd before giving up with the desired state as it "
                  "was (exit 5); 0: wait as long as it takes")
      ->capture_default_str();
  return fleet;
}

int RunFleet(const GlobalOptions& g, const CLI::App& fleet, const FleetOptions& o) {
  const CLI::App* sub = fleet.get_subcommands().at(0);
  const std::string what = "fleet " + sub->get_name();
  absl::StatusOr<std::vector<std::string>> endpoints = fleet::ParseEtcdEndpoints(o.etcd, "--etcd");
  if (!endpoints.ok()) return Fail(g, what, std::string(endpoints.status().message()));
  std::optional<RolloutPlan> plan;
  if (!o.plan_file.empty()) {
    absl::StatusOr<RolloutPlan> p = LoadPlan(o.plan_file);
    if (!p.ok()) return Fail(g, what, std::string(p.status().message()));
    plan = *std::move(p);
  } else if (sub->get_name() == "promote" || sub->get_name() == "undo" ||
             sub->get_name() == "run") {
    return Fail(g, what, "--plan: required (the rollout plan's JSON file)");
  }
  fleet::EtcdKv kv(*std::move(endpoints));
  RolloutController c(
      &kv, o.prefix,
      [&g](const std::string& line) {
        if (!g.json) std::cout << line << std::endl;
      },
      o.etcd_lost_timeout_s > 0 ? absl::Seconds(o.etcd_lost_timeout_s) : absl::InfiniteDuration());
  if (sub->get_name() == "status") return Status(g, c, plan);
  if (sub->get_name() == "promote") return Wrote(g, what, c.Promote(*plan));
  if (sub->get_name() == "undo") return Wrote(g, what, c.Undo(*plan));
  if (sub->get_name() == "abort") return Wrote(g, what, c.Abort(plan, o.reason));
  const std::string prometheus = o.prometheus.empty() ? plan->prometheus : o.prometheus;
  if (prometheus.empty()) {
    return Fail(g, what, "--prometheus: required (the plan gives no 'prometheus')");
  }
  if (prometheus.rfind("http://", 0) != 0) {
    return Fail(g, what, "--prometheus: '" + prometheus + "' is not http://host:port");
  }
  if (!(o.etcd_lost_timeout_s >= 0) || !std::isfinite(o.etcd_lost_timeout_s)) {
    return Fail(g, what,
                absl::StrCat("--etcd_lost_timeout: ", o.etcd_lost_timeout_s,
                             " is not seconds >= 0 (0: wait as long as it takes)"));
  }
  absl::StatusOr<fleet::RunResult> r = c.Run(*plan, prometheus);
  if (!r.ok()) return Fail(g, what, std::string(r.status().message()));
  if (g.json) {
    PrintJson(
        {{"outcome", fleet::OutcomeName(r->outcome)}, {"step", r->step}, {"detail", r->detail}});
  } else {
    std::cout << fleet::OutcomeName(r->outcome) << ": " << r->detail << "\n";
  }
  switch (r->outcome) {
    case fleet::RunResult::Outcome::kComplete:
      return 0;
    case fleet::RunResult::Outcome::kHeld:
      return kExitHeld;
    case fleet::RunResult::Outcome::kRolledBack:
      return kExitRolledBack;
    case fleet::RunResult::Outcome::kEtcdLost:
      return kExitEtcdLost;
  }
  return 1;
}

}  // namespace verifyd::cli
