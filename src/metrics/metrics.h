#pragma once
// Every Prometheus metric verifyd exports, declared once (metrics.cc holds the table).
// Names follow Prometheus conventions: base units, _seconds, _total; labels are low-cardinality.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "src/compare/compare.h"
#include "src/control/mode.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"

namespace verifyd {

struct BuildInfo {
  std::string version, commit, engine, device, compute_capability;
};

class Metrics {
 public:
  explicit Metrics(const BuildInfo& info);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // `served` is "reference", "custom" or "none" (rejected before serving).
  void Request(std::string_view served, absl::StatusCode code, double seconds);
  void PathDuration(Path p, double seconds);
  void ShadowOverhead(double seconds);
  void Comparison(OutcomeKind k);
  // `pair`: "custom_vs_reference", "custom_vs_oracle" or "reference_vs_oracle".
  void Diff(std::string_view pair, const DiffStats& d);
  void SetMode(Mode m, double canary_fraction);
  void SetGate(const GateStatus& g);
  void Rollback(std::string_view reason);
  void OracleError();
  void SetShadowQueueDepth(int64_t depth);
  void Capture(std::string_view trigger);  // "breach" or "requested"

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* request_seconds_;
  prometheus::Family<prometheus::Histogram>* path_seconds_;
  prometheus::Histogram* shadow_overhead_seconds_;
  prometheus::Family<prometheus::Counter>* comparisons_;
  prometheus::Family<prometheus::Histogram>* diff_rel_l2_;
  prometheus::Family<prometheus::Histogram>* diff_max_abs_;
  prometheus::Family<prometheus::Histogram>* diff_max_row_rel_l2_;
  prometheus::Family<prometheus::Gauge>* mode_;
  prometheus::Gauge* canary_fraction_;
  prometheus::Gauge* gate_ready_;
  prometheus::Gauge* gate_clean_;
  prometheus::Family<prometheus::Counter>* rollbacks_;
  prometheus::Counter* oracle_errors_;
  prometheus::Gauge* shadow_queue_depth_;
  prometheus::Family<prometheus::Counter>* captures_;
};

// Serves a registry in the Prometheus text format on http://ADDRESS/metrics (cpp-httplib: its
// threads have ordinary stacks, which the CUDA libraries' static TLS needs). Port 0 picks a free
// port.
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace verifyd
