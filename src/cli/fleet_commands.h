#pragma once
// verifyctl fleet status | promote | undo | abort | run: the rollout controller
// (src/fleet/rollout_controller.h) from the command line, against the fleet's etcd.

#include <string>

#include "CLI/CLI.hpp"
#include "src/cli/cli_common.h"

namespace verifyd::cli {

struct FleetOptions {
  std::string etcd;  // host:port[,host:port...]
  std::string prefix = "/verifyd/fleet";
  std::string plan_file;                   // promote, undo, run (abort: optional)
  std::string prometheus;                  // run: overrides the plan's
  std::string reason = "by the operator";  // abort
  // run: how long a lost etcd is waited for; 0: without bound. 15 minutes rides out a member's
  // restart or a control plane's reboot, and a Job that waits longer fails where it is seen
  // instead of holding unseen; giving up writes nothing, so it is as safe as holding.
  double etcd_lost_timeout_s = 900;
};

// Exit codes of `fleet run` beside 0 (complete) and 1 (an error).
inline constexpr int kExitHeld = 3;        // a node refused or did not act: the step holds
inline constexpr int kExitRolledBack = 4;  // a query failed: the fleet was rolled back
inline constexpr int kExitEtcdLost = 5;    // etcd lost past --etcd_lost_timeout: nothing written

// Adds `fleet` and its subcommands to `app`; returns `fleet`.
CLI::App* AddFleetCommands(CLI::App* app, FleetOptions* o);
int RunFleet(const GlobalOptions& g, const CLI::App& fleet, const FleetOptions& o);

}  // namespace verifyd::cli
