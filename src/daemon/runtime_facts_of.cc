#include "absl/strings/str_cat.h"
#include "src/daemon/daemon.h"

namespace verifyd {
namespace {

// The --inject_custom_fault spelling of a fault; empty for none.
std::string FaultName(const CustomFault& f) {
  switch (f.kind) {
    case CustomFault::Kind::kNone:
      return "";
    case CustomFault::Kind::kError:
      return "error";
    case CustomFault::Kind::kNan:
      return "nan";
    case CustomFault::Kind::kPerturb:
      return absl::StrCat("perturb:", f.amount);
    case CustomFault::Kind::kBf16Pv:
      return "bf16_pv";
  }
  return "unknown";
}

}  // namespace

RuntimeFacts RuntimeFactsOf(const DaemonOptions& o, std::vector<std::string> listen,
                            std::string metrics_address) {
  RuntimeFacts r;
  r.inject_custom_fault = FaultName(o.inject_custom_fault);
  r.tolerance = o.handler.tolerance;
  r.gate_window = o.controller.gate_window;
  r.rollback_breaches = o.controller.rollback_breaches;
  r.rollback_window = o.controller.rollback_window;
  r.oracle_sample_rate = o.handler.oracle_sample_rate;
  r.custom_timeout_seconds = o.handler.custom_timeout_seconds;
  r.listen = std::move(listen);
  r.admin_listen = o.admin_listen;
  r.metrics_address = std::move(metrics_address);
  r.state_dir = o.state_dir;
  return r;
}

}  // namespace verifyd
