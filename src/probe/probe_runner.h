#pragma once
// Runs the probe suite on an engine: reference and custom on every probe bundle, judged by the
// one comparison (src/compare/); a probe marked against_oracle also runs the oracle and holds
// each path to it.

#include <memory>
#include <string>
#include <vector>

#include "src/compare/compare.h"
#include "src/engine/engine.h"
#include "src/probe/invariance.h"
#include "src/probe/probe_suite.h"

namespace verifyd {

struct ProbeResult {
  std::string name, feature;
  bool passed = false;
  std::string reason;  // why it failed: the verdict ("reference vs oracle: ..." when a path
                       // missed the oracle), or the path that errored
  DiffStats stats;     // custom vs reference (when both ran)
  double seconds = 0;  // the paths and the comparisons
  // The failing probe's bundle and outputs, for a capture (failures only).
  std::shared_ptr<PreparedBundle> prepared;
};

struct ProbeReport {
  std::vector<ProbeResult> results;
  int failures = 0;
  double seconds = 0;
  bool passed() const { return failures == 0 && !results.empty(); }
  // "23 of 23 probes passed in 0.81 s" / "2 of 23 probes failed (page_edges/page1: ..., ...)".
  std::string Summary() const;
};

ProbeReport RunProbeSuite(Engine& engine, const std::vector<ProbeBundle>& suite,
                          const Tolerance& tol);

// The invariance probes (src/probe/invariance.h) on the engine's custom path, sized by the probe
// suite's `max_prefix`, appended to `report`: one probe per check and case, named
// "invariance/<case>/<check>", its time added to the report's.
void RunInvarianceProbes(Engine& engine, int64_t max_prefix, InvarianceSweep sweep,
                         ProbeReport* report);

}  // namespace verifyd
