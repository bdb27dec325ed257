#pragma once
// verifyctl status | flip | rollback | sample | capture | probe: the admin service from the
// command line.

#include <string>

#include "src/cli/cli_common.h"

namespace verifyd::cli {

struct FlipOptions {
  std::string mode;  // custom, canary, shadow, reference
  double fraction = 0;
  bool fraction_given = false;  // --fraction was on the command line (canary only)
  std::string reason;           // required
  bool force = false;
};

int RunStatus(const GlobalOptions& g);
int RunFlip(const GlobalOptions& g, const FlipOptions& f);
// Back to shadow; the reason is required, as for flip.
int RunRollback(const GlobalOptions& g, const std::string& reason);
// Fraction of calls that also run the non-served path, for "shadow" or "custom" mode.
struct SampleOptions {
  std::string mode;  // shadow or custom
  double rate = 0;
  std::string reason;
  bool force = false;  // needed for custom 0 (no comparison, so no rollback, while custom serves)
};
int RunSample(const GlobalOptions& g, const SampleOptions& o);
// Capture the next `next` compared calls.
int RunCapture(const GlobalOptions& g, int64_t next);
// Runs the daemon's probe suite now and prints every probe's verdict; exits 1 when one failed
// (recorded by the daemon as a breach, reason "probe").
int RunProbe(const GlobalOptions& g);

}  // namespace verifyd::cli
