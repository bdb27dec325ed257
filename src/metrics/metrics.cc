#include "src/metrics/metrics.h"

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"
#include "src/metrics/buckets.h"
#include "src/metrics/connection_task_queue.h"

namespace verifyd {
namespace {

// Ranges of the two diff histograms, as powers of ten.
constexpr int kRelL2From = -6, kRelL2To = 1;
constexpr int kMaxAbsFrom = -5, kMaxAbsTo = 2;
constexpr int kLseFrom = -7, kLseTo = 1;

constexpr size_t kMaxConnectionThreads = 128;

// Computed once: Add() takes the edges on every call, also for an existing series.
const std::vector<double>& Latency() {
  static const std::vector<double> edges = LatencyBuckets();
  return edges;
}
const std::vector<double>& RelL2() {
  static const std::vector<double> edges = DiffBuckets(kRelL2From, kRelL2To);
  return edges;
}
const std::vector<double>& MaxAbs() {
  static const std::vector<double> edges = DiffBuckets(kMaxAbsFrom, kMaxAbsTo);
  return edges;
}
const std::vector<double>& LseDiff() {
  static const std::vector<double> edges = DiffBuckets(kLseFrom, kLseTo);
  return edges;
}

using CounterFamily = prometheus::Family<prometheus::Counter>;
using GaugeFamily = prometheus::Family<prometheus::Gauge>;
using HistogramFamily = prometheus::Family<prometheus::Histogram>;

// /metrics lists the families of each kind (counter, gauge, histogram) in the order they were
// registered: the order of the areas below, and of the families in each, is the page's order.

// Calls: how many and how long by served path, and what serving adds to a response.
void DeclareCallMetrics(prometheus::Registry& r, CounterFamily** requests,
                        HistogramFamily** request_seconds, HistogramFamily** path_seconds,
                        prometheus::Histogram** shadow_overhead_seconds,
                        prometheus::Histogram** finite_check_seconds) {
  *requests = &prometheus::BuildCounter()
                   .Name("verifyd_requests_total")
                   .Help("Verify calls by served path and gRPC status code")
                   .Register(r);
  *request_seconds = &prometheus::BuildHistogram()
                          .Name("verifyd_request_duration_seconds")
                          .Help("Server time of a Verify call, receive to response, by served path")
                          .Register(r);
  *path_seconds = &prometheus::BuildHistogram()
                       .Name("verifyd_path_duration_seconds")
                       .Help("Time one path (reference, custom, oracle) took on one call")
                       .Register(r);
  *shadow_overhead_seconds =
      &prometheus::BuildHistogram()
           .Name("verifyd_shadow_overhead_seconds")
           .Help("Time added to a response to hand the non-served path off to the shadow queue")
           .Register(r)
           .Add({}, Latency());
  *finite_check_seconds =
      &prometheus::BuildHistogram()
           .Name("verifyd_finite_check_seconds")
           .Help("Time of the NaN/Inf check of a served custom output, before it is returned")
           .Register(r)
           .Add({}, Latency());
}

// Comparisons by outcome and the differences they measured, with every outcome's and pair's
// series present from the start so that dashboards see zeros, not absent series.
void DeclareComparisonMetrics(prometheus::Registry& r, CounterFamily** comparisons,
                              HistogramFamily** diff_rel_l2, HistogramFamily** diff_max_abs,
                              HistogramFamily** diff_max_row_rel_l2,
                              HistogramFamily** diff_lse_max_abs) {
  *comparisons = &prometheus::BuildCounter()
                      .Name("verifyd_comparisons_total")
                      .Help(
                          "Custom-vs-reference comparisons by outcome "
                          "(match, breach, error, timeout, skipped)")
                      .Register(r);
  *diff_rel_l2 = &prometheus::BuildHistogram()
                      .Name("verifyd_diff_rel_l2")
                      .Help("Relative L2 difference ||a-b||/||b|| by pair")
                      .Register(r);
  *diff_max_abs = &prometheus::BuildHistogram()
                       .Name("verifyd_diff_max_abs")
                       .Help("Largest absolute element difference by pair")
                       .Register(r);
  *diff_max_row_rel_l2 = &prometheus::BuildHistogram()
                              .Name("verifyd_diff_max_row_rel_l2")
                              .Help(
                                  "Largest per-row (one head's output) relative L2 difference "
                                  "of a comparison, by pair")
                              .Register(r);
  *diff_lse_max_abs = &prometheus::BuildHistogram()
                           .Name("verifyd_diff_lse_max_abs")
                           .Help(
                               "Largest lse difference (natural log) over the rows of a "
                               "comparison, by pair; a -inf on one side counts as +Inf")
                           .Register(r);
  for (const char* o : {"match", "breach", "error", "timeout", "skipped"}) {
    (*comparisons)->Add({{"outcome", o}});
  }
  for (const char* p : {"custom_vs_reference", "custom_vs_oracle", "reference_vs_oracle"}) {
    (*diff_rel_l2)->Add({{"pair", p}}, RelL2());
    (*diff_max_abs)->Add({{"pair", p}}, MaxAbs());
    (*diff_max_row_rel_l2)->Add({{"pair", p}}, RelL2());
    (*diff_lse_max_abs)->Add({{"pair", p}}, LseDiff());
  }
}

// The mode being served, the flip gate's state, and who made the last change.
void DeclareModeMetrics(prometheus::Registry& r, GaugeFamily** mode,
                        prometheus::Gauge** canary_fraction, prometheus::Gauge** gate_ready,
                        prometheus::Gauge** gate_clean, prometheus::Gauge** mode_forced,
                        GaugeFamily** last_change) {
  *mode = &prometheus::BuildGauge()
               .Name("verifyd_mode")
               .Help("1 for the mode being served (reference, shadow, canary, custom), else 0")
               .Register(r);
  *canary_fraction = &prometheus::BuildGauge()
                          .Name("verifyd_canary_fraction")
                          .Help("Fraction of calls served by the custom path in canary mode")
                          .Register(r)
                          .Add({});
  *gate_ready = &prometheus::BuildGauge()
                     .Name("verifyd_gate_ready")
                     .Help("1 when the flip gate would let canary/custom through now")
                     .Register(r)
                     .Add({});
  *gate_clean = &prometheus::BuildGauge()
                     .Name("verifyd_gate_clean_comparisons")
                     .Help("Clean comparisons in a row, toward the gate's window")
                     .Register(r)
                     .Add({});
  *mode_forced = &prometheus::BuildGauge()
                      .Name("verifyd_mode_forced")
                      .Help(
                          "1 while canary/custom is served because a --force flip overrode a "
                          "closed gate; 0 when the gate's evidence approved it, or in any "
                          "other mode")
                      .Register(r)
                      .Add({});
  *last_change = &prometheus::BuildGauge()
                      .Name("verifyd_last_change_info")
                      .Help(
                          "Always 1: the verified peer (uid on the Unix socket, token hash on "
                          "TCP, verifyd for its own changes) of the last audited change of each "
                          "action (mode, sample_rate)")
                      .Register(r);
}

// The last change's `peer` label: what the transport verified, never the name the client
// claims. A TCP peer without a token is shown without its port (one series per host, not per
// connection).
std::string PeerLabel(const AuditEntry& e) {
  if (e.origin == AuditOrigin::kDaemon) return "verifyd";
  if (e.peer.empty()) return "unknown";  // a line written before peers were recorded
  std::string peer = e.peer;
  for (const char* unverified : {"unverified:ipv4:", "unverified:ipv6:"}) {
    if (absl::StartsWith(peer, unverified)) {
      const size_t colon = peer.rfind(':');
      if (colon > std::strlen(unverified)) peer.resize(colon);
    }
  }
  constexpr size_t kMaxLabel = 80;
  if (peer.size() > kMaxLabel) peer.resize(kMaxLabel);
  return peer;
}

// What takes canary/custom away: rollbacks by reason (each reason's series present from the
// start) and the oracle drift test.
void DeclareRollbackMetrics(prometheus::Registry& r, CounterFamily** rollbacks,
                            prometheus::Gauge** drift_ratio, prometheus::Gauge** drift_t,
                            prometheus::Counter** drift_breaches) {
  *rollbacks = &prometheus::BuildCounter()
                    .Name("verifyd_rollbacks_total")
                    .Help(
                        "Mode changes verifyd made by itself away from canary/custom, by "
                        "reason (tolerance, nan_inf, error, timeout, drift, probe, "
                        "custom_fault, build_changed)")
                    .Register(r);
  *drift_ratio = &prometheus::BuildGauge()
                      .Name("verifyd_drift_ratio")
                      .Help(
                          "Oracle drift: geometric mean of custom's rel-L2 against the oracle "
                          "over the reference's, over the drift window (0: no samples)")
                      .Register(r)
                      .Add({});
  *drift_t = &prometheus::BuildGauge()
                  .Name("verifyd_drift_t")
                  .Help(
                      "Oracle drift: one-sided t statistic against --drift_max_ratio; a "
                      "breach at --drift_min_t (0 before --drift_min_samples)")
                  .Register(r)
                  .Add({});
  *drift_breaches = &prometheus::BuildCounter()
                         .Name("verifyd_drift_breaches_total")
                         .Help("Times the oracle drift test went into breach")
                         .Register(r)
                         .Add({});
  for (const char* reason : {"tolerance", "nan_inf", "error", "timeout", "drift", "probe",
                             "custom_fault", "build_changed"}) {
    (*rollbacks)->Add({{"reason", reason}});
  }
}

// The probe suite's runs and the sampled oracle's failures.
void DeclareProbeMetrics(prometheus::Registry& r, prometheus::Counter** probe_runs,
                         prometheus::Counter** probe_failures,
                         prometheus::Gauge** probe_last_seconds,
                         prometheus::Counter** oracle_errors) {
  *probe_runs = &prometheus::BuildCounter()
                     .Name("verifyd_probe_runs_total")
                     .Help("Runs of the probe suite (start-up, --probe_interval, verifyctl probe)")
                     .Register(r)
                     .Add({});
  *probe_failures = &prometheus::BuildCounter()
                         .Name("verifyd_probe_failures_total")
                         .Help("Runs of the probe suite in which a probe failed")
                         .Register(r)
                         .Add({});
  *probe_last_seconds = &prometheus::BuildGauge()
                             .Name("verifyd_probe_last_duration_seconds")
                             .Help("How long the last run of the probe suite took")
                             .Register(r)
                             .Add({});
  *oracle_errors = &prometheus::BuildCounter()
                        .Name("verifyd_oracle_errors_total")
                        .Help("Sampled oracle runs that failed")
                        .Register(r)
                        .Add({});
}

// What clients were refused or hold: admin calls without the token, registered regions, open
// call channels and the buffers their messages are received into.
void DeclareClientMetrics(prometheus::Registry& r, prometheus::Counter** admin_auth_failures,
                          prometheus::Gauge** regions, prometheus::Gauge** region_bytes,
                          prometheus::Gauge** channels, prometheus::Gauge** receive_buffer_bytes,
                          prometheus::Gauge** receive_buffer_pinned_bytes) {
  *admin_auth_failures = &prometheus::BuildCounter()
                              .Name("verifyd_admin_auth_failures_total")
                              .Help("Admin calls refused for a missing or wrong bearer token")
                              .Register(r)
                              .Add({});
  *regions = &prometheus::BuildGauge()
                  .Name("verifyd_regions")
                  .Help("Registered shared-memory and CUDA IPC regions")
                  .Register(r)
                  .Add({});
  *region_bytes = &prometheus::BuildGauge()
                       .Name("verifyd_region_bytes")
                       .Help("Sum of the byte sizes of the registered regions")
                       .Register(r)
                       .Add({});
  *channels = &prometheus::BuildGauge()
                   .Name("verifyd_channels")
                   .Help("Open call channels (shared-memory request slots with a doorbell)")
                   .Register(r)
                   .Add({});
  *receive_buffer_bytes = &prometheus::BuildGauge()
                               .Name("verifyd_receive_buffer_bytes")
                               .Help(
                                   "Host buffers gRPC request messages are received into, in "
                                   "use or kept for later calls, bytes")
                               .Register(r)
                               .Add({});
  *receive_buffer_pinned_bytes = &prometheus::BuildGauge()
                                      .Name("verifyd_receive_buffer_pinned_bytes")
                                      .Help(
                                          "Of verifyd_receive_buffer_bytes, the bytes pinned "
                                          "for the GPU")
                                      .Register(r)
                                      .Add({});
}

// The shadow queue, and the canary calls it had no place for.
void DeclareShadowMetrics(prometheus::Registry& r, prometheus::Gauge** shadow_queue_depth,
                          prometheus::Counter** canary_shed) {
  *shadow_queue_depth = &prometheus::BuildGauge()
                             .Name("verifyd_shadow_queue_depth")
                             .Help("Comparisons waiting to run off the critical path")
                             .Register(r)
                             .Add({});
  *canary_shed = &prometheus::BuildCounter()
                      .Name("verifyd_canary_shed_total")
                      .Help(
                          "Canary calls served by the reference because the shadow queue had "
                          "no place for their comparison")
                      .Register(r)
                      .Add({});
}

// Captured bundles by trigger (each trigger's series present from the start).
void DeclareCaptureMetrics(prometheus::Registry& r, CounterFamily** captures) {
  *captures = &prometheus::BuildCounter()
                   .Name("verifyd_captures_total")
                   .Help("Bundles written to the capture directory by trigger")
                   .Register(r);
  for (const char* trigger : {"breach", "requested"}) {
    (*captures)->Add({{"trigger", trigger}});
  }
}

// Shadow taps (tap channels), by the stack's backend: the GPU's counts of calls, sampled calls
// and drops, what verifyd made of each fill, and the three pairs' differences and breaches.
void DeclareTapMetrics(prometheus::Registry& r, CounterFamily** events,
                       HistogramFamily** diff_rel_l2, CounterFamily** breaches) {
  *events = &prometheus::BuildCounter()
                 .Name("verifyd_tap_events_total")
                 .Help(
                     "Shadow tap events by the stack's backend: calls (tap calls), taps (sampled "
                     "calls), dropped (sampled while the ring was full), compared, refused (a "
                     "fill that failed its checks)")
                 .Register(r);
  *diff_rel_l2 = &prometheus::BuildHistogram()
                      .Name("verifyd_tap_diff_rel_l2")
                      .Help(
                          "Shadow tap: relative L2 difference by backend and pair "
                          "(custom_vs_reference, stack_vs_reference, custom_vs_stack)")
                      .Register(r);
  *breaches = &prometheus::BuildCounter()
                   .Name("verifyd_tap_breaches_total")
                   .Help("Shadow tap: comparisons past the tolerances, by backend and pair")
                   .Register(r);
}

// In-process switches (switch channels), by model: the steps the stack's GPU decided, by the path
// that served them, and those the op lost to an expired lease.
void DeclareSwitchMetrics(prometheus::Registry& r, CounterFamily** steps,
                          CounterFamily** lease_expired) {
  *steps = &prometheus::BuildCounter()
                .Name("verifyd_switch_steps_total")
                .Help(
                    "In-process switch: captured steps by model and by the path that served "
                    "them (op: the custom kernel in the serving process; stack: its own "
                    "attention), as the stack's GPU counted them")
                .Register(r);
  *lease_expired = &prometheus::BuildCounter()
                        .Name("verifyd_switch_lease_expired_total")
                        .Help(
                            "In-process switch: steps the op would have served but for a lease "
                            "verifyd did not renew in time (it was stopped, hung or starved); "
                            "the stack served them")
                        .Register(r);
}

// A fleet's desired state as this node follows it (src/fleet/).
void DeclareFleetMetrics(prometheus::Registry& r, GaugeFamily** source_up, GaugeFamily** generation,
                         GaugeFamily** in_step, CounterFamily** proposals) {
  *source_up = &prometheus::BuildGauge()
                    .Name("verifyd_fleet_source_up")
                    .Help(
                        "1 while the fleet's desired state (--fleet_file) was read and valid at "
                        "the last look; 0 while it is missing, unreadable or invalid (the node "
                        "keeps its mode)")
                    .Register(r);
  *generation = &prometheus::BuildGauge()
                     .Name("verifyd_fleet_generation")
                     .Help(
                         "The newest generation of the fleet's desired state this node has seen "
                         "(of=seen) and acted on (of=acted)")
                     .Register(r);
  *in_step = &prometheus::BuildGauge()
                  .Name("verifyd_fleet_in_step")
                  .Help("1 when this node is in the rollout step of the generation it acted on")
                  .Register(r);
  *proposals = &prometheus::BuildCounter()
                    .Name("verifyd_fleet_proposals_total")
                    .Help(
                        "Generations of the fleet's desired state this node acted on, by "
                        "outcome: applied, refused (its gate or probe said no), other_build (the "
                        "state is for another build)")
                    .Register(r);
}

void DeclareBuildInfo(prometheus::Registry& r, const BuildInfo& info) {
  prometheus::BuildGauge()
      .Name("verifyd_build_info")
      .Help("Build and engine of this verifyd; always 1")
      .Register(r)
      .Add({{"version", info.version},
            {"commit", info.commit},
            {"engine", info.engine},
            {"device", info.device},
            {"compute_capability", info.compute_capability}})
      .Set(1);
  prometheus::BuildGauge()
      .Name("verifyd_engine_cpu_fallback")
      .Help(
          "1 when --engine=auto serves from the CPU engine on a host that looks like a GPU node "
          "(NVIDIA devices or NVIDIA_VISIBLE_DEVICES): a broken CUDA setup, about 2 s a call")
      .Register(r)
      .Add({})
      .Set(info.cpu_fallback.empty() ? 0 : 1);
}

}  // namespace

// The metric table, area by area.
Metrics::Metrics(const BuildInfo& info) : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  DeclareCallMetrics(r, &requests_, &request_seconds_, &path_seconds_, &shadow_overhead_seconds_,
                     &finite_check_seconds_);
  DeclareComparisonMetrics(r, &comparisons_, &diff_rel_l2_, &diff_max_abs_, &diff_max_row_rel_l2_,
                           &diff_lse_max_abs_);
  DeclareModeMetrics(r, &mode_, &canary_fraction_, &gate_ready_, &gate_clean_, &mode_forced_,
                     &last_change_);
  DeclareRollbackMetrics(r, &rollbacks_, &drift_ratio_, &drift_t_, &drift_breaches_);
  DeclareProbeMetrics(r, &probe_runs_, &probe_failures_, &probe_last_seconds_, &oracle_errors_);
  DeclareClientMetrics(r, &admin_auth_failures_, &regions_, &region_bytes_, &channels_,
                       &receive_buffer_bytes_, &receive_buffer_pinned_bytes_);
  DeclareShadowMetrics(r, &shadow_queue_depth_, &canary_shed_);
  tenancy_refusals_ = &prometheus::BuildCounter()
                           .Name("verifyd_tenancy_refusals_total")
                           .Help(
                               "Calls refused to keep one peer from another's regions and "
                               "channels (reason not_owner) or from more than its share of "
                               "streams, calls and the memory budget (peer_share), and calls "
                               "whose message did not arrive in time (body_timeout)")
                           .Register(r);
  DeclareCaptureMetrics(r, &captures_);
  DeclareTapMetrics(r, &tap_events_, &tap_diff_rel_l2_, &tap_breaches_);
  DeclareSwitchMetrics(r, &switch_steps_, &switch_lease_expired_);
  DeclareFleetMetrics(r, &fleet_source_up_, &fleet_generation_, &fleet_in_step_, &fleet_proposals_);
  DeclareBuildInfo(r, info);
}

void Metrics::Request(std::string_view served, absl::StatusCode code, double seconds) {
  const std::string path(served);
  requests_->Add({{"path", path}, {"code", absl::StatusCodeToString(code)}}).Increment();
  request_seconds_->Add({{"path", path}}, Latency()).Observe(seconds);
}

void Metrics::PathDuration(Path p, double seconds) {
  path_seconds_->Add({{"path", PathName(p)}}, Latency()).Observe(seconds);
}

void Metrics::ShadowOverhead(double seconds) { shadow_overhead_seconds_->Observe(seconds); }

void Metrics::FiniteCheck(double seconds) { finite_check_seconds_->Observe(seconds); }

void Metrics::Comparison(OutcomeKind k) {
  comparisons_->Add({{"outcome", OutcomeName(k)}}).Increment();
}

void Metrics::TapEvents(std::string_view backend, std::string_view event, int64_t n) {
  if (n <= 0) return;
  tap_events_->Add({{"backend", std::string(backend)}, {"event", std::string(event)}})
      .Increment(static_cast<double>(n));
}

void Metrics::Fleet(const fleet::FollowerStatus& s, bool acted) {
  fleet_source_up_->Add({}).Set(s.source_up ? 1 : 0);
  fleet_generation_->Add({{"of", "seen"}}).Set(static_cast<double>(s.generation_seen));
  fleet_generation_->Add({{"of", "acted"}}).Set(static_cast<double>(s.generation_acted));
  fleet_in_step_->Add({}).Set(s.in_step ? 1 : 0);
  for (const char* o : {"applied", "refused", "other_build"})
    fleet_proposals_->Add({{"outcome", o}});
  if (acted) fleet_proposals_->Add({{"outcome", s.last_outcome}}).Increment();
}

void Metrics::SwitchSteps(std::string_view model, std::string_view path, int64_t n) {
  if (n <= 0) return;
  switch_steps_->Add({{"model", std::string(model)}, {"path", std::string(path)}})
      .Increment(static_cast<double>(n));
}

void Metrics::SwitchLeaseExpired(std::string_view model, int64_t n) {
  if (n <= 0) return;
  switch_lease_expired_->Add({{"model", std::string(model)}}).Increment(static_cast<double>(n));
}

namespace {

const char* TapPairName(Metrics::TapPair p) {
  switch (p) {
    case Metrics::TapPair::kCustomVsReference:
      return "custom_vs_reference";
    case Metrics::TapPair::kStackVsReference:
      return "stack_vs_reference";
    case Metrics::TapPair::kCustomVsStack:
      return "custom_vs_stack";
    case Metrics::TapPair::kStackVsOracle:
      return "stack_vs_oracle";
  }
  return "unknown";
}

}  // namespace

void Metrics::TapDiff(std::string_view backend, TapPair pair, const DiffStats& d, bool breach) {
  const std::string b(backend), p(TapPairName(pair));
  tap_diff_rel_l2_->Add({{"backend", b}, {"pair", p}}, RelL2())
      .Observe(std::isfinite(d.rel_l2) ? d.rel_l2 : 1e30);
  prometheus::Counter& c = tap_breaches_->Add({{"backend", b}, {"pair", p}});
  if (breach) c.Increment();
}

void Metrics::Diff(std::string_view pair, const DiffStats& d) {
  const std::string p(pair);
  // NaN/Inf diffs go to the +Inf bucket: Observe(NaN) would poison the sum.
  auto clean = [](double v) { return std::isfinite(v) ? v : 1e30; };
  diff_rel_l2_->Add({{"pair", p}}, RelL2()).Observe(clean(d.rel_l2));
  diff_max_abs_->Add({{"pair", p}}, MaxAbs()).Observe(clean(d.max_abs));
  diff_max_row_rel_l2_->Add({{"pair", p}}, RelL2())
      .Observe(d.zero_row_breaches > 0 ? 1e30 : clean(d.max_row_rel_l2));
  if (!std::isnan(d.lse_max_abs)) {  // NaN: the comparison had no lse
    diff_lse_max_abs_->Add({{"pair", p}}, LseDiff()).Observe(clean(d.lse_max_abs));
  }
}

void Metrics::SetMode(Mode m, double canary_fraction) {
  for (Mode x : {Mode::kReference, Mode::kShadow, Mode::kCanary, Mode::kCustom}) {
    mode_->Add({{"mode", ModeName(x)}}).Set(x == m ? 1 : 0);
  }
  canary_fraction_->Set(m == Mode::kCanary ? canary_fraction : 0);
}

void Metrics::SetGate(const GateStatus& g) {
  gate_ready_->Set(g.ready ? 1 : 0);
  gate_clean_->Set(static_cast<double>(g.clean));
  mode_forced_->Set(g.forced ? 1 : 0);
}

void Metrics::LastChange(const AuditEntry& e) {
  if (e.action == AuditAction::kDenied) return;  // not a change (verifyd_tenancy_refusals_total)
  const bool sample_rate = e.action == AuditAction::kSampleRate;
  absl::MutexLock l(&last_change_mu_);
  prometheus::Gauge*& series = sample_rate ? last_sample_rate_change_ : last_mode_change_;
  if (series != nullptr) last_change_->Remove(series);
  series = &last_change_->Add(
      {{"action", sample_rate ? "sample_rate" : "mode"}, {"peer", PeerLabel(e)}});
  series->Set(1);
}

void Metrics::AdminAuthFailure() { admin_auth_failures_->Increment(); }

void Metrics::TenancyRefusal(std::string_view resource, std::string_view reason) {
  tenancy_refusals_->Add({{"resource", std::string(resource)}, {"reason", std::string(reason)}})
      .Increment();
}

void Metrics::Drift(const DriftReading& r, bool new_breach) {
  drift_ratio_->Set(std::isfinite(r.ratio) ? r.ratio : 0);
  drift_t_->Set(std::isfinite(r.t) ? r.t : 0);
  if (new_breach) drift_breaches_->Increment();
}

void Metrics::Probe(bool passed, double seconds) {
  probe_runs_->Increment();
  if (!passed) probe_failures_->Increment();
  probe_last_seconds_->Set(seconds);
}

void Metrics::Rollback(std::string_view reason) {
  rollbacks_->Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::OracleError() { oracle_errors_->Increment(); }

void Metrics::SetChannels(int64_t channels) { channels_->Set(static_cast<double>(channels)); }

void Metrics::SetReceiveBuffers(uint64_t bytes, uint64_t pinned_bytes) {
  receive_buffer_bytes_->Set(static_cast<double>(bytes));
  receive_buffer_pinned_bytes_->Set(static_cast<double>(pinned_bytes));
}

void Metrics::SetRegions(int64_t regions, uint64_t bytes) {
  regions_->Set(static_cast<double>(regions));
  region_bytes_->Set(static_cast<double>(bytes));
}

void Metrics::SetShadowQueueDepth(int64_t depth) {
  shadow_queue_depth_->Set(static_cast<double>(depth));
}

void Metrics::CanaryShed() { canary_shed_->Increment(); }

void Metrics::Capture(std::string_view trigger) {
  captures_->Add({{"trigger", std::string(trigger)}}).Increment();
}

struct MetricsServer::Impl {
  httplib::Server http;
  std::thread thread;
};

MetricsServer::MetricsServer() : impl_(std::make_unique<Impl>()) {}

MetricsServer::~MetricsServer() {
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<prometheus::Registry> registry,
    std::function<bool()> ready) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_address: '", address, "' is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  std::unique_ptr<MetricsServer> s(new MetricsServer);
  // Exclusive bind: httplib's default sets SO_REUSEPORT, which lets a second daemon share the port.
  s->impl_->http.set_socket_options([](int sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // A scrape is answered within a second whatever other connections do: a thread per
  // connection (bounded) and idle or slow connections closed after a second.
  s->impl_->http.new_task_queue = [] { return new ConnectionTaskQueue(kMaxConnectionThreads); };
  s->impl_->http.set_keep_alive_timeout(1);
  s->impl_->http.set_read_timeout(1, 0);
  s->impl_->http.set_write_timeout(1, 0);
  s->impl_->http.Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(registry->Collect()),
                    "text/plain; version=0.0.4; charset=utf-8");
  });
  s->impl_->http.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  s->impl_->http.Get("/readyz", [ready](const httplib::Request&, httplib::Response& res) {
    const bool ok = !ready || ready();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ready\n" : "not ready\n", "text/plain");
  });
  s->impl_->http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("verifyd: /metrics, /healthz, /readyz\n", "text/plain");
  });
  s->port_ = port == 0 ? s->impl_->http.bind_to_any_port(host)
                       : (s->impl_->http.bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics_address: cannot bind ", address));
  }
  Impl* impl = s->impl_.get();
  impl->thread = std::thread([impl] { impl->http.listen_after_bind(); });
  return s;
}

}  // namespace verifyd
