// verifyd-replay: re-runs reference, custom and oracle on captured or golden bundles with a local
// engine (`verifyctl replay` hands over to it).

#include "CLI/CLI.hpp"
#include "src/common/build_version.h"
#include "src/common/malloc_arenas.h"
#include "src/replay/replay_command.h"

int main(int argc, char** argv) {
  using namespace verifyd::cli;
  verifyd::KeepFreedMemory(int64_t{1} << 30);  // bundles of tens of MB, one after another
  CLI::App app{"verifyd-replay: re-run the paths on captured or golden bundles"};
  app.set_version_flag("--version", "verifyd-replay " VERIFYD_VERSION " (" VERIFYD_GIT_COMMIT ")");
  GlobalOptions g;
  ReplayOptions replay;
  AddReplayOptions(&app, &replay);
  app.add_flag("--json", g.json, "machine-readable output");
  CLI11_PARSE(app, argc, argv);
  return RunReplay(g, replay);
}
