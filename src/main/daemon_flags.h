#pragma once
// verifyd's command line, parsed into DaemonOptions.

#include <string>

#include "absl/status/statusor.h"
#include "src/daemon/daemon.h"

namespace verifyd {

// Parses argv (absl flags). --listen may be given several times or as a comma list.
// --version prints DaemonVersion() and exits 0 (absl's usage flags).
absl::StatusOr<DaemonOptions> ParseDaemonFlags(int argc, char** argv);

// Whether argv asks for help (--help, -help, -h): main prints DaemonHelp() and exits 0.
bool HelpRequested(int argc, char** argv);
// The usage line and every daemon flag with its default and meaning.
std::string DaemonHelp();

}  // namespace verifyd
