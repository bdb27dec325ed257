#pragma once
// The mode state machine (docs/operations.md, "Modes and the flip"): which path serves each call,
// which calls also run the other path, the flip gate, auto-rollback, and durability through
// StateStore.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/compare/compare.h"
#include "src/control/build_identity.h"
#include "src/control/drift_test.h"
#include "src/control/mode.h"
#include "src/control/state_store.h"
#include "src/engine/engine.h"

namespace verifyd {

struct GateStatus {
  bool ready = false;
  int64_t clean = 0;
  int64_t needed = 0;
  std::string reason;
  std::string last_breach;
  // Canary/custom is served because a --force flip overrode a closed gate (not restored after a
  // restart, not opened by evidence): the fact an alert tells apart from "breaches since".
  bool forced = false;
};

struct ControllerOptions {
  int64_t gate_window = 1000;  // clean comparisons in a row needed to flip without --force
  // Shadow taps (RecordTap): once any tapped comparison was recorded, the gate also needs the
  // last tap_gate_window of them, with custom's mean rel-L2 against the stack's output at most
  // tap_gate_ratio x the reference's plus tap_gate_slack (--tap_gate_*).
  int64_t tap_gate_window = 200;
  double tap_gate_ratio = 1.25;
  double tap_gate_slack = 5e-3;    // half the default max_rel_l2: bf16 noise between two paths
  int64_t rollback_breaches = 3;   // K breaches...
  int64_t rollback_window = 1000;  // ...within this many sampled comparisons roll back
  int64_t recent_window = 1000;    // comparisons summarized in status
  uint64_t seed = 0x5eed;          // sampling and canary draws for calls without a request id
  // This binary. state.json binds a flip to canary/custom and the gate's evidence to it: a
  // restart under another build comes back in shadow (when serving custom) with the gate reset.
  BuildIdentity build;
  // The gate's evidence (the clean streak) is saved with every change, when a breach resets it,
  // when the gate opens, on Flush(), and otherwise at most this often while it grows. So the saved
  // streak never overstates the true one, and a crash loses at most this much of its growth.
  absl::Duration evidence_save_interval = absl::Seconds(10);
  // Called once for every mode change the daemon makes by itself that leaves canary/custom, with
  // its reason label: "tolerance", "nan_inf", "error", "timeout" (auto-rollback),
  // "drift", "probe", "custom_fault", "build_changed" (restart). Called with the controller's lock
  // held: it must not call back into the controller.
  std::function<void(std::string_view reason)> on_rollback;
  // Called at start and after every change of mode, sampling or gate (a comparison, a drift
  // reading in breach, a probe), by a client or by the daemon, with the new state and gate.
  // Same lock rule.
  std::function<void(const PersistedState&, const GateStatus&)> on_change;
  // Called with every audit entry a change appends (whether or not the append succeeded), and at
  // start with the newest entry of each action (mode, sample_rate) already in the audit log, so
  // that who made the last change is known across restarts. Same lock rule.
  std::function<void(const AuditEntry&)> on_audit;
  // The oracle drift test (drift_test.h). While it is in breach the gate stays closed, and a
  // daemon serving canary/custom rolls back to shadow with reason "drift".
  DriftOptions drift;
  // Called after every oracle sample with the drift reading, and whether this sample started a
  // drift breach. Same lock rule.
  std::function<void(const DriftReading&, bool new_breach)> on_drift;
  // The gate also needs the probe suite (src/probe/) to have passed, at start-up and on its
  // last run.
  bool require_probe = false;
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
  std::string who;   // the name the client sent, recorded as sent
  std::string peer;  // the identity the transport established; may be empty
};

struct SampleRateChange {
  Mode mode = Mode::kShadow;  // shadow or custom: whose sample rate
  double rate = 0;            // [0, 1]
  std::string who;            // as for ModeChange
  std::string peer;
  std::string reason;  // optional
  // A custom rate of 0 turns every comparison off while custom is served (no rollback can fire
  // then): a client must force it, and the audit log says so.
  bool force = false;
};

struct RecentSummary {
  int64_t comparisons = 0, breaches = 0;
  double rel_l2_mean = 0, rel_l2_max = 0, max_abs_max = 0;
  int64_t oracle_samples = 0;
  double custom_vs_oracle = std::numeric_limits<double>::quiet_NaN();
  double reference_vs_oracle = std::numeric_limits<double>::quiet_NaN();
};

// The oracle drift test as status shows it.
struct DriftStatus {
  DriftReading reading;
  DriftOptions options;
  int64_t breaches = 0;     // times the test went into breach since start
  std::string last_breach;  // time and description of the last one
};

struct ControllerSnapshot {
  PersistedState state;
  GateStatus gate;
  RecentSummary recent;
  DriftStatus drift;
  int64_t rollbacks = 0;  // mode changes by the daemon itself that left canary/custom
  std::string last_rollback_reason;
  int64_t audit_malformed_lines = 0;  // audit.jsonl lines skipped, as of the last read
  // Comparisons recorded since the mode last changed (or since start), and when it changed
  // (empty: not since start).
  int64_t compared_since_mode_change = 0;
  std::string mode_since;
};

class ModeController {
 public:
  // Restores the persisted mode and the gate's evidence. Comes back in shadow, saying why in the
  // log and the audit, after a recorded custom-path fault or under another build than the one
  // that approved canary/custom. Any failure to read an existing state file is an error.
  static absl::StatusOr<std::unique_ptr<ModeController>> Create(StateStore store,
                                                                ControllerOptions opts);

  Plan Decide(std::string_view request_id);

  // Feeds the gate and the rollback window. When this outcome rolls the mode back to shadow the
  // controller logs, audits and counts it (ControllerOptions::on_rollback) itself, and returns
  // the reason label ("tolerance", "nan_inf", "error", "timeout") for the caller's information.
  std::optional<std::string> Record(const Outcome& o);
  // Feeds the recent summary and the drift test. While the drift test is in breach the gate's
  // clean streak stays at 0, and canary/custom rolls back to shadow (reason "drift"), logged,
  // audited and counted as in Record(); returns "drift" then.
  // A shadow tap's comparison: custom's and the reference's rel-L2 against the serving stack's
  // own output. Feeds the gate's tap condition (ControllerOptions::tap_gate_*).
  void RecordTap(double custom_vs_stack_rel_l2, double reference_vs_stack_rel_l2);
  std::optional<std::string> RecordOracle(double custom_vs_oracle_rel_l2,
                                          double reference_vs_oracle_rel_l2);

  // The probe suite's verdict. A failure is a breach (reason "probe"): the gate's clean streak
  // resets, and canary/custom rolls back to shadow, logged, audited and counted as in Record();
  // returns "probe" then. With require_probe the gate stays closed until a run passes.
  std::optional<std::string> RecordProbe(bool passed, const std::string& summary);

  // A client's change. INVALID_ARGUMENT for a bad request, FAILED_PRECONDITION when the gate
  // refuses. Audited with origin "client", whatever name `who` claims.
  absl::StatusOr<PersistedState> SetMode(const ModeChange& c);
  // Fraction of calls that run the non-served path, per mode ("shadow" or "custom"); a client's
  // change, audited (action "sample_rate", origin "client").
  absl::Status SetSampleRate(const SampleRateChange& c);
  absl::Status SetSampleRate(Mode mode, double rate, const std::string& who);
  // A rate given by a start-up flag: audited (origin "daemon", who "flag") when it changes the
  // persisted rate.
  absl::Status ApplySampleRateFlag(Mode mode, double rate);
  // A peer refused another's region or channel: audited (action "denied", origin "daemon",
  // peer `caller`, reason `what`), at most once a minute for each caller and thing, so that a
  // peer that keeps asking cannot fill the log. Changes nothing.
  void AuditDenial(const std::string& caller, const std::string& what);
  // A sticky custom-path fault: persist it and fall back to shadow before the process exits.
  absl::Status MarkCustomFaulted(const std::string& reason);
  // Saves the gate's evidence if it changed since the last save (on clean shutdown).
  absl::Status Flush();

  ControllerSnapshot Snapshot() const;
  // The last `limit` changes in the audit log (refusals, kDenied, stay in the file); malformed
  // lines are skipped, counted and warned about.
  std::vector<AuditEntry> RecentAudit(size_t limit) const;
  int64_t MalformedAuditLines() const;
  Mode mode() const;
  double shadow_sample_rate() const;  // without a Snapshot(): shadow taps follow it
  // The mode and its canary fraction, without a Snapshot(): in-process switches follow them.
  std::pair<Mode, double> serving_mode() const;

 private:
  ModeController(StateStore store, ControllerOptions opts, PersistedState s);
  absl::Status RestoreLocked(bool had_state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Saves `next` (under this build) and appends `e` (time, from, to, fraction and build filled
  // in), then makes `next` current. When the save fails, nothing changes unless `always`.
  absl::Status CommitLocked(PersistedState next, AuditEntry e, bool always)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place where the daemon changes its own mode: persists, audits (origin "daemon"),
  // logs, and counts a change that leaves canary/custom under `label`. The in-memory change
  // happens even when it cannot be saved: serving the reference is always safe.
  absl::Status DaemonChangeLocked(PersistedState next, std::string_view label,
                                  const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SaveLocked(const PersistedState& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A breach of any kind (comparison, drift, probe): the gate's clean streak starts over.
  void ResetGateLocked(std::string last_breach) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Canary/custom back to shadow, by the daemon: logged, audited and counted under `label`.
  std::string RollBackLocked(std::string label, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells on_change the mode and the gate: the one place the gauges learn them from.
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Saves a copy taken under mu_ with sequence number `seq`, unless a newer one was saved.
  absl::Status SaveEvidence(const PersistedState& s, uint64_t seq) ABSL_LOCKS_EXCLUDED(mu_);
  // The evidence to save now, if any: when a breach reset the streak (`reset`), the gate opened
  // or closed, or evidence_save_interval passed. SaveTakenEvidence() then saves it off the lock.
  struct EvidenceSave {
    PersistedState state;
    uint64_t seq = 0;
  };
  std::optional<EvidenceSave> TakeEvidenceLocked(bool reset, bool was_ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SaveTakenEvidence(const std::optional<EvidenceSave>& e) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetSampleRateLocked(const SampleRateChange& c, AuditOrigin origin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  GateStatus GateLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  double DrawLocked(std::string_view request_id, uint64_t salt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteMalformed(const StateStore::AuditLog& log) const;
  // Reads the audit log once at start: warns about malformed lines and tells on_audit the newest
  // entry of each action.
  void AnnounceLastChanges() ABSL_LOCKS_EXCLUDED(mu_);

  const StateStore store_;
  const ControllerOptions opts_;
  mutable absl::Mutex mu_;
  PersistedState state_ ABSL_GUARDED_BY(mu_);
  // When each (caller, what) refusal was last audited (AuditDenial).
  std::map<std::string, absl::Time> denials_audited_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  // state_.gate is the live evidence; these say when it was last saved.
  bool evidence_dirty_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time evidence_saved_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t save_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex save_mu_ ABSL_ACQUIRED_AFTER(mu_);  // one writer of state.json at a time
  uint64_t saved_seq_ ABSL_GUARDED_BY(save_mu_) = 0;
  std::deque<bool> rollback_window_ ABSL_GUARDED_BY(mu_);  // true = breach
  int64_t window_breaches_ ABSL_GUARDED_BY(mu_) = 0;
  struct RecentItem {
    double rel_l2 = 0, max_abs = 0;
    bool breach = false;
  };
  std::deque<RecentItem> recent_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<double, double>> oracle_ ABSL_GUARDED_BY(mu_);
  // Shadow taps: (custom, reference) rel-L2 against the stack's output, the last
  // tap_gate_window, and their sums.
  std::deque<std::pair<double, double>> taps_ ABSL_GUARDED_BY(mu_);
  double tap_sum_custom_ ABSL_GUARDED_BY(mu_) = 0, tap_sum_reference_ ABSL_GUARDED_BY(mu_) = 0;
  DriftTest drift_ ABSL_GUARDED_BY(mu_);
  int64_t drift_breaches_ ABSL_GUARDED_BY(mu_) = 0;
  enum class ProbeState { kNotRun, kPassed, kFailed };
  ProbeState probe_state_ ABSL_GUARDED_BY(mu_) = ProbeState::kNotRun;
  std::string probe_summary_ ABSL_GUARDED_BY(mu_);
  std::string last_drift_breach_ ABSL_GUARDED_BY(mu_);
  int64_t rollbacks_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_rollback_reason_ ABSL_GUARDED_BY(mu_);
  int64_t compared_since_change_ ABSL_GUARDED_BY(mu_) = 0;
  std::string mode_since_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<int64_t> audit_malformed_{0};
  mutable std::atomic<int64_t> audit_malformed_warned_{0};
};

}  // namespace verifyd
