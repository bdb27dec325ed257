#pragma once
// When verifyd runs its probe suite: once at start-up (before it serves, so the gate sees the
// verdict before any flip), every `interval` while canary or custom is served, and on demand
// (verifyctl probe). Every run is judged, counted, and fed to the mode controller: a failure is
// a breach with reason "probe", and its first failing bundle is captured like any breach.

#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "src/capture/capturer.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/metrics/metrics.h"
#include "src/probe/probe_runner.h"

namespace verifyd {

struct ProbeOptions {
  // Run the suite at start-up; the gate then needs it to pass. The daemon's flag turns it on by
  // default (--probe); DaemonOptions leaves it off.
  bool at_start = false;
  double interval_seconds = 600;  // while canary/custom is served; 0: never
  // The invariance probes after the suite: the full sweep at start-up and on demand, the fast
  // subset periodically.
  bool invariance = true;
  ProbeSuiteOptions suite;
};

struct ProbeRunStatus {
  int64_t runs = 0, failed_runs = 0;
  bool has_run = false, last_passed = false;
  std::string last_time, last_trigger, last_summary;
  double last_seconds = 0;
};

class ProbeScheduler {
 public:
  // `capturer` may be null (capture off). Nothing runs until Run() or StartPeriodic().
  ProbeScheduler(Engine* engine, ModeController* controller, Metrics* metrics, Capturer* capturer,
                 ProbeOptions opts, Tolerance tol);
  ~ProbeScheduler();  // stops the periodic thread; waits for a run in progress

  // Builds the suite and runs it now (one run at a time); `trigger` is "start", "interval" or
  // "requested".
  ProbeReport Run(std::string_view trigger) ABSL_LOCKS_EXCLUDED(run_mu_, mu_);
  void StartPeriodic();
  ProbeRunStatus Status() const ABSL_LOCKS_EXCLUDED(mu_);
  const ProbeOptions& options() const { return opts_; }

 private:
  void Capture(const ProbeReport& report, Mode mode);
  void Loop();

  Engine* const engine_;
  ModeController* const controller_;
  Metrics* const metrics_;
  Capturer* const capturer_;
  const ProbeOptions opts_;
  const Tolerance tol_;
  absl::Mutex run_mu_;  // one run at a time
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(run_mu_);
  ProbeRunStatus status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace verifyd
