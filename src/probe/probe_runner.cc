#include "src/probe/probe_runner.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/seconds_since.h"

namespace verifyd {
namespace {

ProbeResult RunOne(Engine& engine, const ProbeBundle& p, const Tolerance& tol) {
  ProbeResult r;
  r.name = p.name;
  r.feature = p.feature;
  const auto start = std::chrono::steady_clock::now();
  auto fail = [&](std::string why) {
    r.reason = std::move(why);
    r.seconds = Since(start);
    return r;
  };
  absl::StatusOr<std::shared_ptr<PreparedBundle>> b = engine.Prepare(p.bundle->view(), true);
  if (!b.ok()) return fail(absl::StrCat("prepare: ", b.status().ToString()));
  for (Path path : {Path::kReference, Path::kCustom}) {
    if (absl::Status st = engine.Run(path, **b); !st.ok()) {
      return fail(absl::StrCat(PathName(path), " path: ", st.ToString()));
    }
  }
  absl::StatusOr<DiffStats> d = engine.Compare(**b, Path::kCustom, Path::kReference, tol);
  if (!d.ok()) return fail(absl::StrCat("compare: ", d.status().ToString()));
  r.stats = *d;
  const Verdict v = Judge(*d, tol);
  r.passed = v.match;
  r.reason = v.reason;
  if (r.passed && p.against_oracle) {
    // Each path against the oracle too, by the same tolerance; the first that misses it fails
    // the probe, named in the reason.
    if (absl::Status st = engine.Run(Path::kOracle, **b); !st.ok()) {
      return fail(absl::StrCat("oracle path: ", st.ToString()));
    }
    for (Path path : {Path::kReference, Path::kCustom}) {
      absl::StatusOr<DiffStats> od = engine.Compare(**b, path, Path::kOracle, tol);
      if (!od.ok()) return fail(absl::StrCat("compare with the oracle: ", od.status().ToString()));
      const Verdict ov = Judge(*od, tol);
      if (!ov.match) {
        r.passed = false;
        r.reason = absl::StrCat(PathName(path), " vs oracle: ", ov.reason);
        break;
      }
    }
  }
  if (!r.passed) r.prepared = *b;
  r.seconds = Since(start);
  return r;
}

}  // namespace

std::string ProbeReport::Summary() const {
  if (results.empty()) return "no probes ran";
  if (failures == 0) {
    return absl::StrFormat("%d of %d probes passed in %.3g s", results.size(), results.size(),
                           seconds);
  }
  std::string s =
      absl::StrFormat("%d of %d probes failed in %.3g s (", failures, results.size(), seconds);
  int shown = 0;
  for (const ProbeResult& r : results) {
    if (r.passed) continue;
    if (shown == 3) {
      absl::StrAppend(&s, ", ...");
      break;
    }
    absl::StrAppend(&s, shown ? "; " : "", r.name, ": ", r.reason);
    ++shown;
  }
  return s + ")";
}

void RunInvarianceProbes(Engine& engine, int64_t max_prefix, InvarianceSweep sweep,
                         ProbeReport* report) {
  const auto start = std::chrono::steady_clock::now();
  const CustomRunner runner = EngineCustomRunner(engine);
  for (const InvarianceCase& c : InvarianceCases(max_prefix, runner.tile_tokens)) {
    for (InvarianceResult& r : RunInvarianceChecks(runner, c, sweep)) {
      ProbeResult p;
      p.name = std::move(r.name);
      p.feature = absl::StrFormat(
          "the custom path against itself (%d runs; row rel-L2 up to %.3g, lse up to %.3g)", r.runs,
          r.agreement.max_row_rel_l2, r.agreement.max_lse_abs);
      p.passed = r.passed;
      p.reason = std::move(r.reason);
      p.seconds = r.seconds;
      report->failures += !p.passed;
      report->results.push_back(std::move(p));
    }
  }
  report->seconds += Since(start);
}

ProbeReport RunProbeSuite(Engine& engine, const std::vector<ProbeBundle>& suite,
                          const Tolerance& tol) {
  ProbeReport report;
  const auto start = std::chrono::steady_clock::now();
  for (const ProbeBundle& p : suite) {
    report.results.push_back(RunOne(engine, p, tol));
    report.failures += !report.results.back().passed;
  }
  report.seconds = Since(start);
  return report;
}

}  // namespace verifyd
