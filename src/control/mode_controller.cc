#include "src/control/mode_controller.h"

#include <algorithm>
#include <cmath>

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
  if (o.stats && (o.stats->nan_test + o.stats->inf_test + o.stats->nan_ref + o.stats->inf_ref) > 0) {
    return "nan_inf";
  }
  return "tolerance";
}

bool ValidRate(double r) { return std::isfinite(r) && r >= 0 && r <= 1; }

}  // namespace

const char* OutcomeName(OutcomeKind k) {
  switch (k) {
    case OutcomeKind::kMatch: return "match";
    case OutcomeKind::kBreach: return "breach";
    case OutcomeKind::kError: return "error";
    case OutcomeKind::kTimeout: return "timeout";
    case OutcomeKind::kSkipped: return "skipped";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<ModeController>> ModeController::Create(StateStore store,
                                                                       ControllerOptions opts) {
  absl::StatusOr<PersistedState> s = store.Load();
  if (!s.ok()) return s.status();
  std::unique_ptr<ModeController> c(new ModeController(std::move(store), opts, *s));
  if (s->custom_faulted && ServesCustom(s->mode)) {
    absl::MutexLock l(&c->mu_);
    absl::Status st = c->ChangeLocked(
        Mode::kShadow, s->canary_fraction,
        "restart after a custom-path fault: " + s->custom_fault_reason, false, "verifyd");
    if (!st.ok()) return st;
  }
  spdlog::info("mode restored from {}: {}", c->store_.dir(), ModeName(c->mode()));
  return c;
}

ModeController::ModeController(StateStore store, ControllerOptions opts, PersistedState s)
    : store_(std::move(store)), opts_(opts), state_(std::move(s)), rng_(opts.seed) {}

Mode ModeController::mode() const {
  absl::ReaderMutexLock l(&mu_);
  return state_.mode;
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
  absl::MutexLock l(&mu_);
  const bool breach = o.kind != OutcomeKind::kMatch;
  if (breach) {
    clean_run_ = 0;
    last_breach_ = absl::StrCat(Now(), " ", OutcomeName(o.kind), ": ", o.reason);
  } else {
    ++clean_run_;
  }
  if (o.stats) {
    recent_.push_back({o.stats->rel_l2, o.stats->max_abs, breach});
  } else {
    recent_.push_back({std::numeric_limits<double>::quiet_NaN(), 0, breach});
  }
  while (static_cast<int64_t>(recent_.size()) > opts_.recent_window) recent_.pop_front();

  // Only comparisons made while custom was being served count toward a rollback.
  if (!ServesCustom(state_.mode) || !ServesCustom(o.mode)) return std::nullopt;
  rollback_window_.push_back(breach);
  window_breaches_ += breach;
  while (static_cast<int64_t>(rollback_window_.size()) > opts_.rollback_window) {
    window_breaches_ -= rollback_window_.front();
    rollback_window_.pop_front();
  }
  if (window_breaches_ < opts_.rollback_breaches) return std::nullopt;

  const std::string label = RollbackLabel(o);
  const std::string why =
      absl::StrFormat("auto-rollback: %d breaches in the last %d sampled comparisons; last: %s",
                      window_breaches_, rollback_window_.size(), last_breach_);
  const Mode from = state_.mode;
  absl::Status st = ChangeLocked(Mode::kShadow, state_.canary_fraction, why, false, "verifyd");
  if (!st.ok()) {
    // The in-memory mode still falls back: serving the reference is always safe.
    state_.mode = Mode::kShadow;
    spdlog::error("auto-rollback could not be persisted: {}", st.ToString());
  }
  ++rollbacks_;
  last_rollback_reason_ = absl::StrCat(label, ": ", why);
  spdlog::warn("rolled back from {} to shadow ({}): {}", ModeName(from), label, why);
  return label;
}

void ModeController::RecordOracle(double custom_vs_oracle, double reference_vs_oracle) {
  absl::MutexLock l(&mu_);
  oracle_.emplace_back(custom_vs_oracle, reference_vs_oracle);
  while (static_cast<int64_t>(oracle_.size()) > opts_.recent_window) oracle_.pop_front();
}

absl::Status ModeController::ChangeLocked(Mode to, double fraction, const std::string& reason,
                                          bool forced, const std::string& who,
                                          const std::string& peer) {
  PersistedState next = state_;
  next.mode = to;
  next.canary_fraction = fraction;
  // Persist before switching: a state we could not write is a state a restart would lose.
  if (absl::Status st = store_.Save(next); !st.ok()) return st;
  AuditEntry e{Now(), state_.mode, to, fraction, reason, forced, who, peer};
  if (absl::Status st = store_.AppendAudit(e); !st.ok()) {
    spdlog::error("audit append failed: {}", st.ToString());
  }
  state_ = next;
  if (ServesCustom(to)) {
    rollback_window_.clear();
    window_breaches_ = 0;
  }
  return absl::OkStatus();
}

GateStatus ModeController::GateLocked() const {
  GateStatus g;
  g.clean = clean_run_;
  g.needed = opts_.gate_window;
  g.ready = clean_run_ >= opts_.gate_window;
  g.last_breach = last_breach_;
  if (!g.ready) {
    g.reason = absl::StrCat(clean_run_, " of ", opts_.gate_window,
                            " comparisons in a row are clean");
    if (!last_breach_.empty()) absl::StrAppend(&g.reason, "; last breach ", last_breach_);
  }
  return g;
}

absl::StatusOr<PersistedState> ModeController::SetMode(const ModeChange& c,
                                                       const std::string& peer) {
  if (c.reason.empty()) return absl::InvalidArgumentError("reason: a reason is required");
  absl::MutexLock l(&mu_);
  double fraction = state_.canary_fraction;
  if (c.mode == Mode::kCanary) {
    if (!(c.canary_fraction > 0 && c.canary_fraction <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("canary_fraction: ", c.canary_fraction, " must be in (0, 1]"));
    }
    fraction = c.canary_fraction;
  }
  if (ServesCustom(c.mode) && !c.force) {
    if (state_.custom_faulted) {
      return absl::FailedPreconditionError(
          "gate: the custom path faulted (" + state_.custom_fault_reason +
          "); --force to serve it anyway");
    }
    GateStatus g = GateLocked();
    if (!g.ready) {
      return absl::FailedPreconditionError("gate: not ready: " + g.reason +
                                           "; --force overrides");
    }
  }
  if (absl::Status st = ChangeLocked(c.mode, fraction, c.reason, c.force, c.who, peer);
      !st.ok()) {
    return st;
  }
  spdlog::info("mode set to {} by {} [{}]{}: {}", ModeName(c.mode), c.who, peer,
               c.force ? " (forced)" : "", c.reason);
  return state_;
}

absl::Status ModeController::SetSampleRate(Mode mode, double rate, const std::string& who) {
  if (!ValidRate(rate)) {
    return absl::InvalidArgumentError(absl::StrCat("sample_rate: ", rate, " must be in [0, 1]"));
  }
  if (mode != Mode::kShadow && mode != Mode::kCustom) {
    return absl::InvalidArgumentError("sample_rate: applies to shadow or custom mode only");
  }
  absl::MutexLock l(&mu_);
  PersistedState next = state_;
  (mode == Mode::kShadow ? next.shadow_sample_rate : next.custom_sample_rate) = rate;
  if (absl::Status st = store_.Save(next); !st.ok()) return st;
  state_ = next;
  spdlog::info("{} sample rate set to {} by {}", ModeName(mode), rate, who);
  return absl::OkStatus();
}

absl::Status ModeController::MarkCustomFaulted(const std::string& reason) {
  absl::MutexLock l(&mu_);
  PersistedState next = state_;
  next.custom_faulted = true;
  next.custom_fault_reason = reason;
  const Mode from = state_.mode;
  next.mode = ServesCustom(from) ? Mode::kShadow : from;
  if (absl::Status st = store_.Save(next); !st.ok()) return st;
  store_.AppendAudit({Now(), from, next.mode, next.canary_fraction,
                      "custom-path fault: " + reason, false, "verifyd", ""})
      .IgnoreError();
  state_ = next;
  return absl::OkStatus();
}

ControllerSnapshot ModeController::Snapshot() const {
  absl::ReaderMutexLock l(&mu_);
  ControllerSnapshot s;
  s.state = state_;
  s.gate = GateLocked();
  s.rollbacks = rollbacks_;
  s.last_rollback_reason = last_rollback_reason_;
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

std::vector<AuditEntry> ModeController::RecentAudit(size_t limit) const {
  auto a = store_.ReadAudit(limit);
  return a.ok() ? *a : std::vector<AuditEntry>{};
}

}  // namespace verifyd
