#pragma once
// What the daemon runs with, as GetStatus reports it: the settings it was started with (fault
// injection, tolerances, rollback thresholds, sampling), its addresses and its start time
// (filled from the daemon's options by RuntimeFactsOf, src/daemon/daemon.h).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "src/compare/compare.h"

namespace verifyd {

struct RuntimeFacts {
  std::string inject_custom_fault;  // empty: none
  Tolerance tolerance;
  int64_t gate_window = 0;
  int64_t rollback_breaches = 0;
  int64_t rollback_window = 0;
  double oracle_sample_rate = 0;
  double custom_timeout_seconds = 0;
  std::vector<std::string> listen;  // as bound
  std::string admin_listen;
  std::string metrics_address;  // as bound; empty: no /metrics
  std::string state_dir;
  std::chrono::system_clock::time_point started = std::chrono::system_clock::now();
  std::chrono::steady_clock::time_point started_steady = std::chrono::steady_clock::now();
};

}  // namespace verifyd
