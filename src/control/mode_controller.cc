#include "src/control/mode_controller.h"

#include <algorithm>
#include <cmath>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace verifyd {
namespace {

// FNV-1a: stable across processes and restarts, so a request id keeps its canary assignment.
uint64_t StableHash(std::string_view s, uint64_t salt) {
  uint64_t h = 1469598103934665603ull ^ salt;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

std::string Now() { return absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()); }

std::string RollbackLabel(const Outcome& o) {
  if (o.kind == OutcomeKind::kError) return "error";
  if (o.kind == OutcomeKind::kTimeout) return "timeout";
  if (o.stats &&
      (o.stats->nan_test + o.stats->inf_test + o.stats->nan_ref + o.stats->inf_ref) > 0) {
    return "nan_inf";
  }
  return "tolerance";
}

}  // namespace

const char* OutcomeName(OutcomeKind k) {
  switch (k) {
    case OutcomeKind::kMatch:
      return "match";
    case OutcomeKind::kBreach:
      return "breach";
    case OutcomeKind::kError:
      return "error";
    case OutcomeKind::kTimeout:
      return "timeout";
    case OutcomeKind::kSkipped:
      return "skipped";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<ModeController>> ModeController::Create(StateStore store,
                                                                       ControllerOptions opts) {
  absl::StatusOr<std::optional<PersistedState>> s = store.Read();
  if (!s.ok()) return s.status();
  const bool had_state = s->has_value();
  PersistedState state = s->value_or(PersistedState{});
  if (!had_state) state.build = opts.build;
  std::unique_ptr<ModeController> c(new ModeController(std::move(store), std::move(opts), state));
  c->AnnounceLastChanges();  // before the restore, whose own changes come after them
  {
    absl::MutexLock l(&c->mu_);
    if (absl::Status st = c->RestoreLocked(had_state); !st.ok()) return st;
    c->NotifyLocked();
  }
  return c;
}

absl::Status ModeController::RestoreLocked(bool had_state) {
  const std::string& dir = store_.dir();
  if (!had_state) {
    spdlog::info("no state file in {}; starting in shadow", dir);
    return absl::OkStatus();
  }
  // The gate's evidence and a flip's approval hold for the build that recorded them only.
  const bool same_build = state_.build == opts_.build;
  const std::string build_note =
      absl::StrCat("restart under build ", opts_.build.ToString(),
                   "; the state was recorded under ", state_.build.ToString(),
                   ": the gate's evidence (", state_.gate.clean, " clean) does not carry over");
  PersistedState next = state_;
  if (!same_build) {
    next.gate = {};
    next.forced = false;
  }
  absl::Status st;
  if (state_.custom_faulted && ServesCustom(state_.mode)) {
    next.mode = Mode::kShadow;
    st = DaemonChangeLocked(std::move(next), "custom_fault",
                            "restart after a custom-path fault: " + state_.custom_fault_reason +
                                (same_build ? "" : "; " + build_note));
  } else if (!same_build && ServesCustom(state_.mode)) {
    next.mode = Mode::kShadow;
    st = DaemonChangeLocked(std::move(next), "build_changed",
                            build_note + ", and canary/custom needs the gate again (or --force)");
  } else if (!same_build) {
    next.build = opts_.build;
    st = SaveLocked(next);
    if (st.ok()) {
      state_ = std::move(next);
      spdlog::info("{}", build_note);
    }
  }
  if (!st.ok()) return st;
  const GateStatus g = GateLocked();
  spdlog::info("mode restored from {}: {} (gate {} of {} clean{}{})", dir, ModeName(state_.mode),
               g.clean, g.needed, g.ready ? ", ready" : "", g.forced ? "; entered by --force" : "");
  return absl::OkStatus();
}

ModeController::ModeController(StateStore store, ControllerOptions opts, PersistedState s)
    : store_(std::move(store)),
      opts_(std::move(opts)),
      state_(std::move(s)),
      rng_(opts_.seed),
      drift_(opts_.drift) {}

Mode ModeController::mode() const {
  absl::ReaderMutexLock l(&mu_);
  return state_.mode;
}

std::pair<Mode, double> ModeController::serving_mode() const {
  absl::ReaderMutexLock l(&mu_);
  return {state_.mode, state_.canary_fraction};
}

double ModeController::shadow_sample_rate() const {
  absl::ReaderMutexLock l(&mu_);
  return state_.shadow_sample_rate;
}

double ModeController::DrawLocked(std::string_view request_id, uint64_t salt) {
  if (!request_id.empty()) {
    return static_cast<double>(StableHash(request_id, salt) >> 11) * 0x1.0p-53;
  }
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

Plan ModeController::Decide(std::string_view request_id) {
  absl::MutexLock l(&mu_);
  Plan p;
  p.mode = state_.mode;
  switch (state_.mode) {
    case Mode::kReference:
      break;
    case Mode::kShadow:
      p.run_other = DrawLocked(request_id, 1) < state_.shadow_sample_rate;
      break;
    case Mode::kCanary:
      if (DrawLocked(request_id, 2) < state_.canary_fraction) {
        p.served = Path::kCustom;
        p.run_other = true;  // every canary call is checked against the reference
      } else {
        p.run_other = DrawLocked(request_id, 1) < state_.shadow_sample_rate;
      }
      break;
    case Mode::kCustom:
      p.served = Path::kCustom;
      p.run_other = DrawLocked(request_id, 3) < state_.custom_sample_rate;
      break;
  }
  return p;
}

std::optional<std::string> ModeController::Record(const Outcome& o) {
  if (o.kind == OutcomeKind::kSkipped) return std::nullopt;
  std::optional<EvidenceSave> to_save;
  std::optional<std::string> label;
  {
    absl::MutexLock l(&mu_);
    const bool breach = o.kind != OutcomeKind::kMatch;
    ++compared_since_change_;
    const bool was_ready = GateLocked().ready;
    const bool was_clean = state_.gate.clean > 0;
    if (breach) {
      ResetGateLocked(absl::StrCat(Now(), " ", OutcomeName(o.kind), ": ", o.reason));
    } else {
      ++state_.gate.clean;
      evidence_dirty_ = true;
    }
    if (o.stats) {
      recent_.push_back({o.stats->rel_l2, o.stats->max_abs, breach});
    } else {
      recent_.push_back({std::numeric_limits<double>::quiet_NaN(), 0, breach});
    }
    while (static_cast<int64_t>(recent_.size()) > opts_.recent_window) recent_.pop_front();

    // Only comparisons made while custom was being served count toward a rollback.
    if (ServesCustom(state_.mode) && ServesCustom(o.mode)) {
      rollback_window_.push_back(breach);
      window_breaches_ += breach;
      while (static_cast<int64_t>(rollback_window_.size()) > opts_.rollback_window) {
        window_breaches_ -= rollback_window_.front();
        rollback_window_.pop_front();
      }
      if (window_breaches_ >= opts_.rollback_breaches) {
        label = RollBackLocked(
            RollbackLabel(o),
            absl::StrFormat("%d breaches in the last %d sampled comparisons; "
                            "last: %s",
                            window_breaches_, rollback_window_.size(), state_.gate.last_breach));
      }
    }
    to_save = TakeEvidenceLocked(breach && was_clean, was_ready);
    NotifyLocked();
  }
  SaveTakenEvidence(to_save);
  return label;
}

std::optional<ModeController::EvidenceSave> ModeController::TakeEvidenceLocked(bool reset,
                                                                               bool was_ready) {
  // Save the evidence when a breach resets the streak or the gate opens (never overstate
  // it on disk), and otherwise at most every evidence_save_interval while it grows.
  const absl::Time now = absl::Now();
  if (!evidence_dirty_ || !(reset || GateLocked().ready != was_ready ||
                            now - evidence_saved_at_ >= opts_.evidence_save_interval)) {
    return std::nullopt;
  }
  evidence_saved_at_ = now;
  evidence_dirty_ = false;
  return EvidenceSave{state_, ++save_seq_};
}

void ModeController::SaveTakenEvidence(const std::optional<EvidenceSave>& e) {
  if (!e) return;
  if (absl::Status st = SaveEvidence(e->state, e->seq); !st.ok()) {
    spdlog::error("gate evidence could not be saved: {}", st.ToString());
    absl::MutexLock l(&mu_);
    evidence_dirty_ = true;
  }
}

absl::Status ModeController::SaveLocked(const PersistedState& s) {
  const uint64_t seq = ++save_seq_;
  absl::MutexLock l(&save_mu_);
  if (absl::Status st = store_.Save(s); !st.ok()) return st;
  saved_seq_ = seq;
  return absl::OkStatus();
}

absl::Status ModeController::SaveEvidence(const PersistedState& s, uint64_t seq) {
  absl::MutexLock l(&save_mu_);
  if (seq <= saved_seq_) return absl::OkStatus();  // a newer state is already on disk
  if (absl::Status st = store_.Save(s); !st.ok()) return st;
  saved_seq_ = seq;
  return absl::OkStatus();
}

absl::Status ModeController::Flush() {
  PersistedState s;
  uint64_t seq = 0;
  {
    absl::MutexLock l(&mu_);
    if (!evidence_dirty_) return absl::OkStatus();
    s = state_;
    seq = ++save_seq_;
    evidence_saved_at_ = absl::Now();
    evidence_dirty_ = false;
  }
  absl::Status st = SaveEvidence(s, seq);
  if (!st.ok()) {
    absl::MutexLock l(&mu_);
    evidence_dirty_ = true;
  }
  return st;
}

void ModeController::RecordTap(double custom_vs_stack, double reference_vs_stack) {
  absl::MutexLock l(&mu_);
  const bool was_ready = GateLocked().ready;
  taps_.emplace_back(custom_vs_stack, reference_vs_stack);
  tap_sum_custom_ += custom_vs_stack;
  tap_sum_reference_ += reference_vs_stack;
  while (static_cast<int64_t>(taps_.size()) > opts_.tap_gate_window) {
    tap_sum_custom_ -= taps_.front().first;
    tap_sum_reference_ -= taps_.front().second;
    taps_.pop_front();
  }
  if (GateLocked().ready != was_ready) NotifyLocked();
}

std::optional<std::string> ModeController::RecordOracle(double custom_vs_oracle,
                                                        double reference_vs_oracle) {
  std::optional<EvidenceSave> to_save;
  std::optional<std::string> label;
  {
    absl::MutexLock l(&mu_);
    oracle_.emplace_back(custom_vs_oracle, reference_vs_oracle);
    while (static_cast<int64_t>(oracle_.size()) > opts_.recent_window) oracle_.pop_front();
    const bool was_breach = drift_.Reading().breach;
    const DriftReading r = drift_.Add(custom_vs_oracle, reference_vs_oracle);
    const bool new_breach = r.breach && !was_breach;
    if (new_breach) {
      ++drift_breaches_;
      last_drift_breach_ = absl::StrCat(Now(), " ", DescribeDrift(r, drift_.options()));
      spdlog::warn("oracle drift: {}", DescribeDrift(r, drift_.options()));
    } else if (was_breach && !r.breach) {
      spdlog::info("oracle drift cleared: {}", DescribeDrift(r, drift_.options()));
    }
    if (r.breach) {
      // Every sample in breach counts against the gate, like a breaching comparison.
      const bool was_ready = GateLocked().ready;
      const bool was_clean = state_.gate.clean > 0;
      ResetGateLocked(absl::StrCat("drift: ", last_drift_breach_));
      if (ServesCustom(state_.mode)) {
        label = RollBackLocked("drift", "oracle drift: " + DescribeDrift(r, drift_.options()));
      }
      to_save = TakeEvidenceLocked(was_clean, was_ready);
    }
    if (r.breach || was_breach) NotifyLocked();  // the drift holds the gate closed, or let go
    if (opts_.on_drift) opts_.on_drift(r, new_breach);
  }
  SaveTakenEvidence(to_save);
  return label;
}

std::optional<std::string> ModeController::RecordProbe(bool passed, const std::string& summary) {
  std::optional<EvidenceSave> to_save;
  std::optional<std::string> label;
  {
    absl::MutexLock l(&mu_);
    const bool was_ready = GateLocked().ready;
    probe_state_ = passed ? ProbeState::kPassed : ProbeState::kFailed;
    probe_summary_ = summary;
    if (!passed) {
      const bool was_clean = state_.gate.clean > 0;
      ResetGateLocked(absl::StrCat(Now(), " probe: ", summary));
      if (ServesCustom(state_.mode)) label = RollBackLocked("probe", "probe suite: " + summary);
      to_save = TakeEvidenceLocked(was_clean, was_ready);
    } else {
      to_save = TakeEvidenceLocked(false, was_ready);
    }
    NotifyLocked();
  }
  SaveTakenEvidence(to_save);
  return label;
}

void ModeController::ResetGateLocked(std::string last_breach) {
  state_.gate.clean = 0;
  state_.gate.last_breach = std::move(last_breach);
  evidence_dirty_ = true;
}

std::string ModeController::RollBackLocked(std::string label, const std::string& why) {
  PersistedState next = state_;
  next.mode = Mode::kShadow;
  // Logged there; the in-memory rollback happened even when the state could not be saved.
  DaemonChangeLocked(next, label, "auto-rollback: " + why).IgnoreError();
  return label;
}

void ModeController::NotifyLocked() {
  if (opts_.on_change) opts_.on_change(state_, GateLocked());
}

absl::Status ModeController::CommitLocked(PersistedState next, AuditEntry e, bool always) {
  next.build = opts_.build;
  if (!ServesCustom(next.mode)) next.forced = false;
  e.time = Now();
  e.from = state_.mode;
  e.to = next.mode;
  e.canary_fraction =
      e.action == AuditAction::kMode && next.mode == Mode::kCanary ? next.canary_fraction : 0;
  e.build = opts_.build;
  // Persist before switching: a state we could not write is a state a restart would lose.
  absl::Status saved = SaveLocked(next);
  if (!saved.ok()) {
    if (!always) return saved;
    absl::StrAppend(&e.reason, " (state.json not saved: ", saved.message(), ")");
  }
  if (absl::Status st = store_.AppendAudit(e); !st.ok()) {
    spdlog::error("audit append failed: {}", st.ToString());
  }
  if (opts_.on_audit) opts_.on_audit(e);
  state_ = std::move(next);
  evidence_dirty_ = !saved.ok();
  if (e.action == AuditAction::kMode && ServesCustom(e.to)) {
    rollback_window_.clear();
    window_breaches_ = 0;
  }
  if (e.action == AuditAction::kMode && e.from != e.to) {
    compared_since_change_ = 0;
    mode_since_ = e.time;
  }
  NotifyLocked();
  return saved;
}

absl::Status ModeController::DaemonChangeLocked(PersistedState next, std::string_view label,
                                                const std::string& why) {
  const Mode from = state_.mode;
  AuditEntry e;
  e.action = AuditAction::kMode;
  e.origin = AuditOrigin::kDaemon;
  e.who = "verifyd";
  e.reason = why;
  absl::Status st = CommitLocked(std::move(next), std::move(e), /*always=*/true);
  if (!st.ok()) spdlog::error("the change below could not be saved: {}", st.ToString());
  if (from == state_.mode) {
    spdlog::warn("verifyd recorded in {} mode ({}): {}", ModeName(from), label, why);
  } else {
    spdlog::warn("verifyd changed the mode from {} to {} ({}): {}", ModeName(from),
                 ModeName(state_.mode), label, why);
  }
  if (ServesCustom(from) && !ServesCustom(state_.mode)) {
    ++rollbacks_;
    last_rollback_reason_ = absl::StrCat(std::string(label), ": ", why);
    if (opts_.on_rollback) opts_.on_rollback(label);
  }
  return st;
}

GateStatus ModeController::GateLocked() const {
  GateStatus g;
  g.clean = state_.gate.clean;
  g.needed = opts_.gate_window;
  const DriftReading drift = drift_.Reading();
  const bool probe_ok = !opts_.require_probe || probe_state_ == ProbeState::kPassed;
  // A tapped deployment: custom must agree with the stack's own output about as well as the
  // reference does, over a full window of tapped comparisons.
  std::string tap_why;
  if (!taps_.empty()) {
    const auto n = static_cast<int64_t>(taps_.size());
    const double custom = tap_sum_custom_ / n, reference = tap_sum_reference_ / n;
    if (n < opts_.tap_gate_window) {
      tap_why = absl::StrCat("; ", n, " of ", opts_.tap_gate_window, " tapped comparisons");
    } else if (!(custom <= opts_.tap_gate_ratio * reference + opts_.tap_gate_slack)) {
      tap_why = absl::StrCat("; tapped: custom's mean rel-L2 against the stack's output ", custom,
                             " > ", opts_.tap_gate_ratio, " x the reference's ", reference, " + ",
                             opts_.tap_gate_slack);
    }
  }
  g.ready = g.clean >= opts_.gate_window && !drift.breach && probe_ok && tap_why.empty();
  g.last_breach = state_.gate.last_breach;
  g.forced = ServesCustom(state_.mode) && state_.forced;
  if (!g.ready) {
    g.reason = absl::StrCat(g.clean, " of ", opts_.gate_window, " comparisons in a row are clean");
    if (drift.breach) {
      absl::StrAppend(&g.reason, "; oracle drift: ", DescribeDrift(drift, drift_.options()));
    }
    if (!probe_ok) {
      absl::StrAppend(&g.reason, probe_state_ == ProbeState::kNotRun
                                     ? "; the probe suite has not passed yet"
                                     : "; the probe suite failed: " + probe_summary_);
    }
    absl::StrAppend(&g.reason, tap_why);
    if (!g.last_breach.empty()) absl::StrAppend(&g.reason, "; last breach ", g.last_breach);
  }
  return g;
}

absl::StatusOr<PersistedState> ModeController::SetMode(const ModeChange& c) {
  if (c.reason.empty()) return absl::InvalidArgumentError("reason: a reason is required");
  absl::MutexLock l(&mu_);
  PersistedState next = state_;
  next.mode = c.mode;
  if (c.mode == Mode::kCanary) {
    // No fraction given (0): the persisted one, 0.05 until an operator set another.
    if (c.canary_fraction != 0) next.canary_fraction = c.canary_fraction;
    if (absl::Status st = ValidateState(next); !st.ok()) return st;
  }
  bool past_gate = false;
  if (ServesCustom(c.mode)) {
    const GateStatus g = GateLocked();
    past_gate = state_.custom_faulted || !g.ready;
    if (past_gate && !c.force) {
      if (state_.custom_faulted) {
        return absl::FailedPreconditionError("gate: the custom path faulted (" +
                                             state_.custom_fault_reason +
                                             "); --force to serve it anyway");
      }
      return absl::FailedPreconditionError("gate: not ready: " + g.reason + "; --force overrides");
    }
  }
  next.forced = past_gate;
  // The kill switch: whatever the gate had seen no longer vouches for custom, so the way back
  // to canary/custom starts with a fresh clean window in shadow.
  if (c.mode == Mode::kReference && state_.mode != Mode::kReference) {
    next.gate.clean = 0;
    next.gate.last_breach = absl::StrCat(Now(), " kill switch (flip reference): ", c.reason);
  }
  AuditEntry e;
  e.action = AuditAction::kMode;
  e.origin = AuditOrigin::kClient;
  e.reason = c.reason;
  e.forced = c.force;
  e.who = c.who;
  e.peer = c.peer;
  if (absl::Status st = CommitLocked(std::move(next), std::move(e), false); !st.ok()) return st;
  spdlog::info("mode set to {} by {}{}: {}", ModeName(c.mode), c.who,
               c.force ? (past_gate ? " (forced past the gate)" : " (forced)") : "", c.reason);
  return state_;
}

absl::Status ModeController::SetSampleRateLocked(const SampleRateChange& c, AuditOrigin origin) {
  if (c.mode != Mode::kShadow && c.mode != Mode::kCustom) {
    return absl::InvalidArgumentError("sample_rate: applies to shadow or custom mode only");
  }
  PersistedState next = state_;
  double& rate = c.mode == Mode::kShadow ? next.shadow_sample_rate : next.custom_sample_rate;
  const double previous = rate;
  rate = c.rate;
  if (absl::Status st = ValidateState(next); !st.ok()) return st;
  const bool unchecked = c.mode == Mode::kCustom && c.rate == 0;
  if (unchecked && origin == AuditOrigin::kClient && !c.force) {
    // The custom rate applies only while custom is served and is kept until then: outside
    // custom mode the refusal says that nothing changes now.
    if (state_.mode != Mode::kCustom) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rate: the mode is ", ModeName(state_.mode),
          ", so nothing changes now, but custom mode keeps this rate: a custom sample rate of 0 "
          "would compare nothing once custom is served, so no breach would be seen and no "
          "rollback could fire; give --force (recorded in the audit log) to set it anyway"));
    }
    return absl::FailedPreconditionError(
        "rate: a custom sample rate of 0 compares nothing while custom is served, so no breach is "
        "seen and no rollback can fire; give --force (recorded in the audit log) to do it anyway");
  }
  if (unchecked && c.rate != previous) {
    spdlog::warn("custom sample rate 0 (by {}): the served custom path goes unchecked", c.who);
  }
  if (origin == AuditOrigin::kDaemon && previous == c.rate) return absl::OkStatus();
  AuditEntry e;
  e.action = AuditAction::kSampleRate;
  e.origin = origin;
  e.reason = c.reason;
  e.who = c.who;
  e.peer = c.peer;
  e.sample_mode = c.mode;
  e.sample_rate = c.rate;
  e.previous_sample_rate = previous;
  e.forced = c.force;
  if (absl::Status st = CommitLocked(std::move(next), std::move(e), false); !st.ok()) return st;
  spdlog::info("{} sample rate set from {} to {} by {}", ModeName(c.mode), previous, c.rate, c.who);
  return absl::OkStatus();
}

void ModeController::AuditDenial(const std::string& caller, const std::string& what) {
  constexpr size_t kKept = 4096;  // distinct (caller, what) pairs remembered
  const absl::Time now = absl::Now();
  AuditEntry e;
  {
    absl::MutexLock l(&mu_);
    absl::Time& last = denials_audited_[absl::StrCat(caller, "\n", what)];
    if (now - last < absl::Minutes(1)) return;
    last = now;
    if (denials_audited_.size() > kKept) {
      for (auto it = denials_audited_.begin(); it != denials_audited_.end();) {
        it = now - it->second >= absl::Minutes(1) ? denials_audited_.erase(it) : std::next(it);
      }
    }
    e.from = e.to = state_.mode;
  }
  e.time = Now();
  e.action = AuditAction::kDenied;
  e.origin = AuditOrigin::kDaemon;
  e.who = "verifyd";
  e.peer = caller;
  e.reason = what;
  e.build = opts_.build;
  if (absl::Status st = store_.AppendAudit(e); !st.ok()) {
    spdlog::error("audit append failed: {}", st.ToString());
  }
}

absl::Status ModeController::SetSampleRate(const SampleRateChange& c) {
  absl::MutexLock l(&mu_);
  return SetSampleRateLocked(c, AuditOrigin::kClient);
}

absl::Status ModeController::SetSampleRate(Mode mode, double rate, const std::string& who) {
  SampleRateChange c;
  c.mode = mode;
  c.rate = rate;
  c.who = who;
  return SetSampleRate(c);
}

absl::Status ModeController::ApplySampleRateFlag(Mode mode, double rate) {
  SampleRateChange c;
  c.mode = mode;
  c.rate = rate;
  c.who = "flag";
  c.reason = "start-up flag";
  absl::MutexLock l(&mu_);
  return SetSampleRateLocked(c, AuditOrigin::kDaemon);
}

absl::Status ModeController::MarkCustomFaulted(const std::string& reason) {
  absl::MutexLock l(&mu_);
  PersistedState next = state_;
  next.custom_faulted = true;
  next.custom_fault_reason = reason;
  if (ServesCustom(next.mode)) next.mode = Mode::kShadow;
  return DaemonChangeLocked(std::move(next), "custom_fault", "custom-path fault: " + reason);
}

ControllerSnapshot ModeController::Snapshot() const {
  absl::ReaderMutexLock l(&mu_);
  ControllerSnapshot s;
  s.state = state_;
  s.gate = GateLocked();
  s.rollbacks = rollbacks_;
  s.last_rollback_reason = last_rollback_reason_;
  s.compared_since_mode_change = compared_since_change_;
  s.mode_since = mode_since_;
  s.audit_malformed_lines = audit_malformed_.load();
  s.drift.reading = drift_.Reading();
  s.drift.options = drift_.options();
  s.drift.breaches = drift_breaches_;
  s.drift.last_breach = last_drift_breach_;
  RecentSummary& r = s.recent;
  double sum = 0;
  int64_t finite = 0;
  for (const auto& it : recent_) {
    ++r.comparisons;
    r.breaches += it.breach;
    if (std::isfinite(it.rel_l2)) {
      sum += it.rel_l2;
      ++finite;
      r.rel_l2_max = std::max(r.rel_l2_max, it.rel_l2);
    }
    r.max_abs_max = std::max(r.max_abs_max, it.max_abs);
  }
  r.rel_l2_mean = finite ? sum / finite : 0;
  if (!oracle_.empty()) {
    double c = 0, ref = 0;
    for (const auto& [a, b] : oracle_) {
      c += a;
      ref += b;
    }
    r.oracle_samples = static_cast<int64_t>(oracle_.size());
    r.custom_vs_oracle = c / oracle_.size();
    r.reference_vs_oracle = ref / oracle_.size();
  }
  return s;
}

void ModeController::NoteMalformed(const StateStore::AuditLog& log) const {
  audit_malformed_ = log.malformed_lines;
  // Warn once per newly damaged line, not on every status call.
  int64_t warned = audit_malformed_warned_.load();
  while (log.malformed_lines > warned) {
    if (audit_malformed_warned_.compare_exchange_weak(warned, log.malformed_lines)) {
      spdlog::warn("{}: {} malformed line(s) skipped (first: {})", store_.audit_path(),
                   log.malformed_lines, log.first_malformed);
      break;
    }
  }
}

std::vector<AuditEntry> ModeController::RecentAudit(size_t limit) const {
  std::deque<AuditEntry> changes;
  absl::StatusOr<StateStore::AuditLog> log = store_.ReadAuditLog(0, [&](const AuditEntry& e) {
    if (e.action == AuditAction::kDenied) return;
    changes.push_back(e);
    if (changes.size() > limit) changes.pop_front();
  });
  if (!log.ok()) {
    spdlog::warn("audit log: {}", log.status().ToString());
    return {};
  }
  NoteMalformed(*log);
  return {std::make_move_iterator(changes.begin()), std::make_move_iterator(changes.end())};
}

void ModeController::AnnounceLastChanges() {
  std::optional<AuditEntry> mode, sample_rate;
  absl::StatusOr<StateStore::AuditLog> log = store_.ReadAuditLog(0, [&](const AuditEntry& e) {
    if (e.action == AuditAction::kDenied) return;
    (e.action == AuditAction::kSampleRate ? sample_rate : mode) = e;
  });
  if (!log.ok()) {
    spdlog::warn("audit log: {}", log.status().ToString());
    return;
  }
  NoteMalformed(*log);  // warns about a damaged audit log at start
  if (!opts_.on_audit) return;
  absl::MutexLock l(&mu_);
  if (mode) opts_.on_audit(*mode);
  if (sample_rate) opts_.on_audit(*sample_rate);
}

int64_t ModeController::MalformedAuditLines() const {
  absl::StatusOr<StateStore::AuditLog> log = store_.ReadAuditLog(0);
  if (log.ok()) NoteMalformed(*log);
  return audit_malformed_.load();
}

}  // namespace verifyd
