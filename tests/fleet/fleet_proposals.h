#pragma once
// The proposals a FleetFollower under test makes, recorded in order ("mode fraction | reason"),
// answered with `answer` after `takes`.

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/control/mode.h"
#include "src/fleet/fleet_follower.h"

namespace verifyd::fleet {

struct Proposals {
  absl::Mutex mu;
  std::vector<std::string> asked;  // "mode fraction | reason"
  absl::Status answer = absl::OkStatus();
  // How long a proposal takes after it is counted (a mode change writes state.json): the
  // follower's status follows the proposal's return, not its start.
  absl::Duration takes = absl::ZeroDuration();
  FleetFollower::Propose fn() {
    return [this](const NodeTarget& t, const std::string& reason) {
      absl::Status a;
      absl::Duration d;
      {
        absl::MutexLock l(&mu);
        asked.push_back(absl::StrCat(ModeName(t.mode), " ", t.canary_fraction, " | ", reason));
        a = answer;
        d = takes;
      }
      absl::SleepFor(d);
      return a;
    };
  }
  size_t count() {
    absl::MutexLock l(&mu);
    return asked.size();
  }
  std::string last() {
    absl::MutexLock l(&mu);
    return asked.empty() ? "" : asked.back();
  }
};

}  // namespace verifyd::fleet
