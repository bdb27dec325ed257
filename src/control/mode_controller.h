#pragma once
// The mode state machine of DESIGN §4: which path serves each call, which calls also run the
// other path, the flip gate, auto-rollback, and durability through StateStore.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/compare/compare.h"
#include "src/control/mode.h"
#include "src/control/state_store.h"
#include "src/engine/engine.h"

namespace verifyd {

struct ControllerOptions {
  int64_t gate_window = 1000;      // clean comparisons in a row needed to flip without --force
  int64_t rollback_breaches = 3;   // K breaches...
  int64_t rollback_window = 1000;  // ...within this many sampled comparisons roll back
  int64_t recent_window = 1000;    // comparisons summarized in status
  uint64_t seed = 0x5eed;          // sampling and canary draws for calls without a request id
};

// What to do with one call.
struct Plan {
  Mode mode = Mode::kShadow;
  Path served = Path::kReference;
  bool run_other = false;  // also run the non-served path and compare
};

enum class OutcomeKind { kMatch, kBreach, kError, kTimeout, kSkipped };
const char* OutcomeName(OutcomeKind k);  // "match", "breach", "error", "timeout", "skipped"

// The result of comparing custom against reference on one call.
struct Outcome {
  OutcomeKind kind = OutcomeKind::kMatch;
  Mode mode = Mode::kShadow;  // the mode the call was planned in
  std::string reason;         // breach/error detail
  std::optional<DiffStats> stats;
};

struct ModeChange {
  Mode mode = Mode::kShadow;
  double canary_fraction = 0;  // canary only, in (0, 1]
  std::string reason;          // required
  bool force = false;
  std::string who;  // as the client claims
};

struct GateStatus {
  bool ready = false;
  int64_t clean = 0;
  int64_t needed = 0;
  std::string reason;
  std::string last_breach;
};

struct RecentSummary {
  int64_t comparisons = 0, breaches = 0;
  double rel_l2_mean = 0, rel_l2_max = 0, max_abs_max = 0;
  int64_t oracle_samples = 0;
  double custom_vs_oracle = std::numeric_limits<double>::quiet_NaN();
  double reference_vs_oracle = std::numeric_limits<double>::quiet_NaN();
};

struct ControllerSnapshot {
  PersistedState state;
  GateStatus gate;
  RecentSummary recent;
  int64_t rollbacks = 0;
  std::string last_rollback_reason;
};

class ModeController {
 public:
  // Restores the persisted mode. A recorded custom-path fault brings it back in shadow.
  static absl::StatusOr<std::unique_ptr<ModeController>> Create(StateStore store,
                                                                ControllerOptions opts);

  Plan Decide(std::string_view request_id);

  // Feeds the gate and the rollback window. Returns the rollback reason label ("tolerance",
  // "nan_inf", "error", "timeout") when this outcome rolled the mode back to shadow.
  std::optional<std::string> Record(const Outcome& o);
  void RecordOracle(double custom_vs_oracle_rel_l2, double reference_vs_oracle_rel_l2);

  // INVALID_ARGUMENT for a bad request, FAILED_PRECONDITION when the gate refuses.
  // `peer`: who the daemon verified made the change (kernel uid or token identity), audited
  // beside the claimed `c.who`.
  absl::StatusOr<PersistedState> SetMode(const ModeChange& c, const std::string& peer = "");
  // Fraction of calls that run the non-served path, per mode ("shadow" or "custom").
  absl::Status SetSampleRate(Mode mode, double rate, const std::string& who);
  // A sticky custom-path fault: persist it and fall back to shadow before the process exits.
  absl::Status MarkCustomFaulted(const std::string& reason);

  ControllerSnapshot Snapshot() const;
  std::vector<AuditEntry> RecentAudit(size_t limit) const;
  Mode mode() const;

 private:
  ModeController(StateStore store, ControllerOptions opts, PersistedState s);
  absl::Status ChangeLocked(Mode to, double fraction, const std::string& reason, bool forced,
                            const std::string& who, const std::string& peer = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  GateStatus GateLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  double DrawLocked(std::string_view request_id, uint64_t salt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StateStore store_;
  const ControllerOptions opts_;
  mutable absl::Mutex mu_;
  PersistedState state_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  int64_t clean_run_ ABSL_GUARDED_BY(mu_) = 0;  // consecutive clean comparisons
  std::string last_breach_ ABSL_GUARDED_BY(mu_);
  std::deque<bool> rollback_window_ ABSL_GUARDED_BY(mu_);  // true = breach
  int64_t window_breaches_ ABSL_GUARDED_BY(mu_) = 0;
  struct RecentItem {
    double rel_l2 = 0, max_abs = 0;
    bool breach = false;
  };
  std::deque<RecentItem> recent_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<double, double>> oracle_ ABSL_GUARDED_BY(mu_);
  int64_t rollbacks_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_rollback_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
