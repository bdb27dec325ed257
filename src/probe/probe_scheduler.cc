#include "src/probe/probe_scheduler.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace verifyd {

ProbeScheduler::ProbeScheduler(Engine* engine, ModeController* controller, Metrics* metrics,
                               Capturer* capturer, ProbeOptions opts, Tolerance tol)
    : engine_(engine),
      controller_(controller),
      metrics_(metrics),
      capturer_(capturer),
      opts_(std::move(opts)),
      tol_(tol) {}

ProbeScheduler::~ProbeScheduler() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock run(&run_mu_);  // a run on demand finishes before the engine goes
}

ProbeReport ProbeScheduler::Run(std::string_view trigger) {
  absl::MutexLock run(&run_mu_);
  const Mode mode = controller_->mode();
  ProbeReport report = RunProbeSuite(*engine_, BuildProbeSuite(opts_.suite), tol_);
  if (opts_.invariance) {
    RunInvarianceProbes(*engine_, opts_.suite.max_prefix,
                        trigger == "interval" ? InvarianceSweep::kFast : InvarianceSweep::kFull,
                        &report);
  }
  const std::string summary = report.Summary();
  if (report.passed()) {
    spdlog::info("probe suite ({}): {}", trigger, summary);
  } else {
    spdlog::warn("probe suite ({}): {}", trigger, summary);
  }
  {
    // The run shows in status before its consequences (a rollback) do.
    absl::MutexLock l(&mu_);
    ++status_.runs;
    status_.failed_runs += !report.passed();
    status_.has_run = true;
    status_.last_passed = report.passed();
    status_.last_time = absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone());
    status_.last_trigger = std::string(trigger);
    status_.last_summary = summary;
    status_.last_seconds = report.seconds;
  }
  metrics_->Probe(report.passed(), report.seconds);
  // A rollback is logged, audited and counted by the controller, and the gauges follow it.
  controller_->RecordProbe(report.passed(), summary);
  if (!report.passed()) Capture(report, mode);
  return report;
}

void ProbeScheduler::Capture(const ProbeReport& report, Mode mode) {
  if (capturer_ == nullptr) return;
  for (const ProbeResult& r : report.results) {
    if (r.passed || r.prepared == nullptr) continue;
    const std::string trigger = capturer_->Claim(true);
    if (trigger.empty()) return;
    ComparisonRecord rec;
    absl::StatusOr<std::shared_ptr<const OwnedBundle>> inputs = engine_->FetchInputs(*r.prepared);
    if (!inputs.ok()) {
      spdlog::warn("probe capture skipped: {}", inputs.status().ToString());
      return;
    }
    rec.bundle = *inputs;
    rec.plan.mode = mode;
    rec.plan.run_other = true;
    rec.outcome = {OutcomeKind::kBreach, mode, absl::StrCat("probe ", r.name, ": ", r.reason),
                   r.stats};
    rec.tolerance = tol_;
    rec.request_id = "probe:" + r.name;
    engine_->Fetch(Path::kReference, *r.prepared, &rec.reference).IgnoreError();
    engine_->Fetch(Path::kCustom, *r.prepared, &rec.custom).IgnoreError();
    absl::StatusOr<std::string> path = capturer_->Write(rec, trigger);
    if (path.ok()) {
      metrics_->Capture(trigger);
      spdlog::info("captured {} (probe {})", *path, r.name);
    } else {
      spdlog::warn("probe capture failed: {}", path.status().ToString());
    }
    return;  // the first failing probe
  }
}

void ProbeScheduler::StartPeriodic() {
  if (opts_.interval_seconds <= 0 || thread_.joinable()) return;
  thread_ = std::thread([this] { Loop(); });
}

void ProbeScheduler::Loop() {
  const absl::Duration interval = absl::Seconds(opts_.interval_seconds);
  while (true) {
    {
      absl::MutexLock l(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), interval)) return;
    }
    if (ServesCustom(controller_->mode())) Run("interval");
  }
}

ProbeRunStatus ProbeScheduler::Status() const {
  absl::MutexLock l(&mu_);
  return status_;
}

}  // namespace verifyd
