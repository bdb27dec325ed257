#pragma once
// verifyd-replay FILE... (and `verifyctl replay`, which hands over to it): re-runs reference,
// custom and oracle on captured (or golden) bundles with the local engine and prints the
// comparisons. A capture's recorded comparison is recomputed from its recorded outputs
// ("matches_metadata": equal to the rel_l2 it recorded), and "reproduced" means the local re-run
// gave both recorded outputs bit for bit. A golden file's o_expected/lse_expected are checked.

#include <string>
#include <vector>

#include "src/cli/cli_common.h"

namespace CLI {
class App;
}  // namespace CLI

namespace verifyd::cli {

struct ReplayOptions {
  std::vector<std::string> files;
  std::string engine = "auto";
  double golden_max_rel_l2 = 1e-2;  // bf16 paths vs a golden file's fp64 answer
  double golden_max_lse_abs = 1e-3;
};

// The replay options, on `app` (verifyd-replay's own, or verifyctl's replay subcommand).
void AddReplayOptions(CLI::App* app, ReplayOptions* r);

// Exit code: 0 when every golden check passes and every file loaded; 1 otherwise.
int RunReplay(const GlobalOptions& g, const ReplayOptions& r);

}  // namespace verifyd::cli
