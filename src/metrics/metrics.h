#pragma once
// Every Prometheus metric verifyd exports, declared once (metrics.cc holds the table).
// Names follow Prometheus conventions: base units, _seconds, _total; labels are low-cardinality.

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "src/compare/compare.h"
#include "src/control/mode.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/fleet/fleet_follower.h"

namespace verifyd {

struct BuildInfo {
  std::string version, commit, engine, device, compute_capability;
  // Why --engine=auto serves from the CPU on a host that looks like a GPU node; empty otherwise.
  std::string cpu_fallback;
};

class Metrics {
 public:
  explicit Metrics(const BuildInfo& info);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // `served` is "reference", "custom" or "none" (rejected before serving).
  void Request(std::string_view served, absl::StatusCode code, double seconds);
  void PathDuration(Path p, double seconds);
  void ShadowOverhead(double seconds);
  void FiniteCheck(double seconds);  // the served custom output's NaN/Inf check
  void Comparison(OutcomeKind k);
  // `pair`: "custom_vs_reference", "custom_vs_oracle" or "reference_vs_oracle".
  void Diff(std::string_view pair, const DiffStats& d);
  void SetMode(Mode m, double canary_fraction);
  void SetGate(const GateStatus& g);  // also verifyd_mode_forced
  // The last audited change of `e`'s action (mode or sample rate) and the verified peer that
  // made it: one series per action, the previous one removed.
  void LastChange(const AuditEntry& e);
  void Rollback(std::string_view reason);
  // After every oracle sample: the drift test's reading; `new_breach` when it went into breach.
  void Drift(const DriftReading& r, bool new_breach);
  // One run of the probe suite.
  void Probe(bool passed, double seconds);
  void OracleError();
  void AdminAuthFailure();
  void SetShadowQueueDepth(int64_t depth);
  // Registered regions and the sum of their byte sizes.
  void SetRegions(int64_t regions, uint64_t bytes);
  void SetChannels(int64_t channels);
  // One refusal that keeps a peer from another's resources or from more than its share:
  // `resource` region, channel, stream, call or budget; `reason` not_owner, peer_share or
  // body_timeout.
  void TenancyRefusal(std::string_view resource, std::string_view reason);
  // Host memory gRPC messages are received into (in use or kept for later calls), and how much
  // of it is pinned.
  void SetReceiveBuffers(uint64_t bytes, uint64_t pinned_bytes);
  // A canary call served by the reference because its comparison could not be queued.
  void CanaryShed();
  void Capture(std::string_view trigger);  // "breach" or "requested"
  // Shadow taps: `n` events of `event` (calls, taps, dropped, compared, refused) of a backend;
  // one comparison of a pair of the three outputs (and the stack's against the oracle).
  enum class TapPair { kCustomVsReference, kStackVsReference, kCustomVsStack, kStackVsOracle };
  void TapEvents(std::string_view backend, std::string_view event, int64_t n);
  void TapDiff(std::string_view backend, TapPair pair, const DiffStats& d, bool breach);
  // In-process switches (switch channels), by model: `n` steps served on `path` (op or stack),
  // and steps the op would have served but for an expired lease.
  void SwitchSteps(std::string_view model, std::string_view path, int64_t n);
  void SwitchLeaseExpired(std::string_view model, int64_t n);
  // The fleet's desired state as this node follows it (--fleet_file): after each look, and
  // `acted` when it acted on a new generation. Nothing is exported until the first call.
  void Fleet(const fleet::FollowerStatus& s, bool acted);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* tenancy_refusals_;
  prometheus::Family<prometheus::Histogram>* request_seconds_;
  prometheus::Family<prometheus::Histogram>* path_seconds_;
  prometheus::Histogram* shadow_overhead_seconds_;
  prometheus::Histogram* finite_check_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* comparisons_;
  prometheus::Family<prometheus::Histogram>* diff_rel_l2_;
  prometheus::Family<prometheus::Histogram>* diff_max_abs_;
  prometheus::Family<prometheus::Histogram>* diff_max_row_rel_l2_;
  prometheus::Family<prometheus::Histogram>* diff_lse_max_abs_;
  prometheus::Family<prometheus::Gauge>* mode_;
  prometheus::Gauge* canary_fraction_;
  prometheus::Gauge* gate_ready_;
  prometheus::Gauge* gate_clean_;
  prometheus::Gauge* mode_forced_;
  prometheus::Family<prometheus::Gauge>* last_change_;
  absl::Mutex last_change_mu_;
  prometheus::Gauge* last_mode_change_ ABSL_GUARDED_BY(last_change_mu_) = nullptr;
  prometheus::Gauge* last_sample_rate_change_ ABSL_GUARDED_BY(last_change_mu_) = nullptr;
  prometheus::Family<prometheus::Counter>* rollbacks_;
  prometheus::Gauge* drift_ratio_;
  prometheus::Gauge* drift_t_;
  prometheus::Counter* drift_breaches_;
  prometheus::Counter* probe_runs_;
  prometheus::Counter* probe_failures_;
  prometheus::Gauge* probe_last_seconds_;
  prometheus::Counter* oracle_errors_;
  prometheus::Counter* admin_auth_failures_;
  prometheus::Gauge* shadow_queue_depth_;
  prometheus::Gauge* regions_;
  prometheus::Gauge* region_bytes_;
  prometheus::Gauge* channels_;
  prometheus::Gauge* receive_buffer_bytes_;
  prometheus::Gauge* receive_buffer_pinned_bytes_;
  prometheus::Counter* canary_shed_;
  prometheus::Family<prometheus::Counter>* captures_;
  prometheus::Family<prometheus::Counter>* tap_events_;
  prometheus::Family<prometheus::Histogram>* tap_diff_rel_l2_;
  prometheus::Family<prometheus::Counter>* tap_breaches_;
  prometheus::Family<prometheus::Counter>* switch_steps_;
  prometheus::Family<prometheus::Counter>* switch_lease_expired_;
  prometheus::Family<prometheus::Gauge>* fleet_source_up_;
  prometheus::Family<prometheus::Gauge>* fleet_generation_;
  prometheus::Family<prometheus::Gauge>* fleet_in_step_;
  prometheus::Family<prometheus::Counter>* fleet_proposals_;
};

// Serves a registry in the Prometheus text format on http://ADDRESS/metrics (cpp-httplib: its
// threads have ordinary stacks, which the CUDA libraries' static TLS needs). Port 0 picks a free
// port. For load balancers and probes that do not speak gRPC, on the same port:
//   /healthz  200 while the process answers;
//   /readyz   200 when `ready()` says so (no callback: always), else 503.
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry,
      std::function<bool()> ready = nullptr);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace verifyd
