#pragma once
// verifyd's command line, parsed into DaemonOptions.

#include "absl/status/statusor.h"
#include "src/server/daemon.h"

namespace verifyd {

// Parses argv (absl flags). --listen may be given several times or as a comma list.
absl::StatusOr<DaemonOptions> ParseDaemonFlags(int argc, char** argv);

}  // namespace verifyd
