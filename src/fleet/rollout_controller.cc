#include "src/fleet/rollout_controller.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "src/fleet/prometheus_query.h"

namespace verifyd::fleet {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(250);

void Pause(absl::Duration d) { std::this_thread::sleep_for(absl::ToChronoNanoseconds(d)); }

std::string Seconds(absl::Duration d) { return absl::StrCat(absl::ToInt64Seconds(d), " s"); }

// etcd did not answer (down, unreachable, too slow), as opposed to an answer that is an error.
bool Lost(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace

const char* OutcomeName(RunResult::Outcome o) {
  switch (o) {
    case RunResult::Outcome::kComplete:
      return "complete";
    case RunResult::Outcome::kHeld:
      return "held";
    case RunResult::Outcome::kRolledBack:
      return "rolled_back";
    case RunResult::Outcome::kEtcdLost:
      return "etcd_lost";
  }
  return "unknown";
}

RolloutController::RolloutController(EtcdKv* kv, std::string prefix,
                                     std::function<void(const std::string&)> say,
                                     absl::Duration etcd_lost_timeout)
    : kv_(kv),
      prefix_(absl::StripSuffix(prefix, "/")),
      say_(std::move(say)),
      etcd_lost_timeout_(etcd_lost_timeout) {}

absl::StatusOr<FleetView> RolloutController::Read() {
  FleetView v;
  absl::StatusOr<std::optional<EtcdValue>> desired = kv_->Get(prefix_ + "/desired");
  if (!desired.ok()) return desired.status();
  if (desired->has_value()) {
    v.desired_revision = (*desired)->mod_revision;
    absl::StatusOr<DesiredState> s = ParseDesiredState((*desired)->value);
    if (s.ok()) {
      v.desired = *std::move(s);
    } else {
      v.desired_error = std::string(s.status().message());
    }
  }
  absl::StatusOr<std::vector<EtcdValue>> nodes = kv_->List(prefix_ + "/nodes/");
  if (!nodes.ok()) return nodes.status();
  for (const EtcdValue& kv : *nodes) {
    absl::StatusOr<NodeReport> r = ParseNodeReport(kv.value);
    if (r.ok()) {
      v.nodes.push_back(*std::move(r));
    } else {
      v.unreadable.push_back(absl::StrCat(kv.key, ": ", r.status().message()));
    }
  }
  return v;
}

absl::StatusOr<DesiredState> RolloutController::Write(const FleetView& view,
                                                      const RolloutPlan& plan, int index,
                                                      const std::string& reason) {
  const int64_t generation = (view.desired ? view.desired->generation : 0) + 1;
  DesiredState s = PlanState(plan, index, generation, reason);
  absl::Status st =
      kv_->PutIfUnchanged(prefix_ + "/desired", SerializeDesiredState(s), view.desired_revision);
  if (!st.ok()) return st;
  return s;
}

absl::StatusOr<FleetView> RolloutController::ReadThroughLoss(absl::Duration* lost) {
  if (lost) *lost = absl::ZeroDuration();
  absl::StatusOr<FleetView> view = Read();
  if (view.ok() || !Lost(view.status())) return view;
  const bool bounded = etcd_lost_timeout_ != absl::InfiniteDuration();
  say_(absl::StrCat("  etcd lost: ", view.status().message(), ": waiting for it",
                    bounded ? absl::StrCat(" (at most ", Seconds(etcd_lost_timeout_), ")") : "",
                    ", the desired state unchanged"));
  const absl::Time since = absl::Now();
  while (!view.ok() && Lost(view.status())) {
    if (absl::Now() - since >= etcd_lost_timeout_) {
      return absl::UnavailableError(absl::StrCat("etcd ", kv_->Describe(), " did not answer for ",
                                                 Seconds(absl::Now() - since), " (",
                                                 view.status().message(), ")"));
    }
    Pause(kPoll);
    view = Read();
  }
  if (lost) *lost = absl::Now() - since;
  if (view.ok()) say_(absl::StrCat("  etcd back after ", Seconds(absl::Now() - since)));
  return view;
}

absl::StatusOr<DesiredState> RolloutController::WriteThroughLoss(const FleetView& view,
                                                                 const RolloutPlan& plan, int index,
                                                                 const std::string& reason) {
  for (;;) {
    absl::StatusOr<DesiredState> s = Write(view, plan, index, reason);
    if (s.ok() || !Lost(s.status())) return s;
    const int64_t generation = (view.desired ? view.desired->generation : 0) + 1;
    absl::StatusOr<FleetView> now = ReadThroughLoss();
    if (!now.ok()) {
      if (!Lost(now.status())) return now.status();
      return absl::UnavailableError(absl::StrCat(now.status().message(), "; generation ",
                                                 generation, " (", DescribeStep(plan, index),
                                                 ") was being written and may have landed"));
    }
    if (now->desired_revision == view.desired_revision) continue;  // it did not land
    const DesiredState want = PlanState(plan, index, generation, reason);
    if (now->desired && SerializeDesiredState(*now->desired) == SerializeDesiredState(want)) {
      return want;
    }
    return absl::AbortedError(
        absl::StrCat(prefix_, "/desired changed while etcd was lost: another writer came first"));
  }
}

absl::StatusOr<DesiredState> RolloutController::Promote(const RolloutPlan& plan) {
  absl::StatusOr<FleetView> view = Read();
  if (!view.ok()) return view.status();
  const int now = StepOf(plan, view->desired);
  const int next = now + 1;
  if (next >= static_cast<int>(plan.steps.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rollout ", plan.name, " is at its last step already (", DescribeStep(plan, now), ")"));
  }
  return Write(*view, plan, next,
               absl::StrCat("rollout ", plan.name, ": promote to ", DescribeStep(plan, next)));
}

absl::StatusOr<DesiredState> RolloutController::Undo(const RolloutPlan& plan) {
  absl::StatusOr<FleetView> view = Read();
  if (!view.ok()) return view.status();
  const int now = StepOf(plan, view->desired);
  if (now < 0) {
    return absl::FailedPreconditionError(absl::StrCat("the desired state is at no step of rollout ",
                                                      plan.name, ": nothing to undo"));
  }
  return Write(*view, plan, now - 1,
               absl::StrCat("rollout ", plan.name, ": undo to ", DescribeStep(plan, now - 1)));
}

absl::StatusOr<DesiredState> RolloutController::Abort(const std::optional<RolloutPlan>& plan,
                                                      const std::string& why) {
  absl::StatusOr<FleetView> view = Read();
  if (!view.ok()) return view.status();
  RolloutPlan p;
  if (plan) {
    p = *plan;
  } else {
    p.name = "(no plan)";
    p.stable_mode = view->desired ? view->desired->stable_mode : Mode::kShadow;
  }
  return Write(*view, p, -1, absl::StrCat("rollout ", p.name, " aborted: ", why));
}

absl::Status RolloutController::Settle(const RolloutPlan& plan, const DesiredState& desired) {
  absl::Time deadline = absl::Now() + plan.settle_timeout;
  for (;;) {
    absl::Duration lost;
    absl::StatusOr<FleetView> view = ReadThroughLoss(&lost);
    if (!view.ok()) return view.status();
    deadline += lost;  // no node could report while etcd was lost
    const GenerationProgress p = ProgressOf(desired, view->nodes);
    if (view->nodes.empty()) {
      if (absl::Now() >= deadline) {
        return absl::FailedPreconditionError(
            absl::StrCat("no node reports under ", prefix_, "/nodes/"));
      }
    } else if (p.pending.empty() && !p.refused.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(p.refused.size(), " node(s) refused generation ", desired.generation, ": ",
                       absl::StrJoin(p.refused, "; ")));
    } else if (p.pending.empty()) {
      say_(absl::StrCat("  every node acted on generation ", desired.generation, ": ", p.in_step,
                        " of ", view->nodes.size(), " in the step"));
      return absl::OkStatus();
    } else if (absl::Now() >= deadline) {
      return absl::FailedPreconditionError(absl::StrCat(
          p.pending.size(), " node(s) did not act on generation ", desired.generation, " within ",
          Seconds(plan.settle_timeout), ": ", absl::StrJoin(p.pending, ", "),
          p.refused.empty() ? "" : absl::StrCat("; refused: ", absl::StrJoin(p.refused, "; "))));
    }
    Pause(kPoll);
  }
}

std::vector<std::string> RolloutController::Analyze(const RolloutPlan& plan,
                                                    const std::string& prometheus) {
  std::vector<std::string> failed, passed;
  for (const AnalysisQuery& q : plan.queries) {
    const QueryVerdict v = Judge(q, PromQuery(prometheus, q.query, absl::Seconds(5)));
    (v.pass ? passed : failed).push_back(v.detail);
  }
  say_(absl::StrCat("  analysis: ", failed.empty() ? "pass" : "FAIL", ": ",
                    absl::StrJoin(failed.empty() ? passed : failed, "; ")));
  return failed;
}

absl::StatusOr<RunResult> RolloutController::Run(const RolloutPlan& plan,
                                                 const std::string& prometheus) {
  absl::StatusOr<FleetView> view = Read();
  if (!view.ok()) return view.status();
  const int last = static_cast<int>(plan.steps.size()) - 1;
  int step = std::max(0, StepOf(plan, view->desired));
  int64_t generation = view->desired ? view->desired->generation : 0;  // as etcd has it
  // etcd lost past etcd_lost_timeout_ (`st`): the run ends at `step`, nothing written since.
  auto gave_up = [&](const absl::Status& st, const std::string& then) -> absl::StatusOr<RunResult> {
    if (!Lost(st)) return st;
    const std::string detail =
        absl::StrCat(st.message(), ": gave up at ", DescribeStep(plan, step), ", ", prefix_,
                     "/desired last known at generation ", generation, then);
    say_(absl::StrCat("  ", detail));
    return RunResult{RunResult::Outcome::kEtcdLost, step, detail};
  };
  const std::string resume = "; fleet run goes on from it once etcd answers";
  for (;; ++step) {
    absl::StatusOr<DesiredState> desired = WriteThroughLoss(
        *view, plan, step,
        absl::StrCat("rollout ", plan.name, ": run at ", DescribeStep(plan, step)));
    if (!desired.ok()) return gave_up(desired.status(), resume);
    generation = desired->generation;
    say_(absl::StrCat(DescribeStep(plan, step), ": generation ", desired->generation, ", ",
                      ModeName(plan.mode), " on the nodes below ", plan.steps[step],
                      " of the hash space"));
    if (absl::Status st = Settle(plan, *desired); !st.ok()) {
      if (st.code() != absl::StatusCode::kFailedPrecondition) return gave_up(st, resume);
      say_(absl::StrCat("  held at ", DescribeStep(plan, step), ": ", st.message()));
      return RunResult{RunResult::Outcome::kHeld, step, std::string(st.message())};
    }
    const absl::Time start = absl::Now();
    for (;;) {
      const std::vector<std::string> failed = Analyze(plan, prometheus);
      if (!failed.empty()) {
        const std::string why = absl::StrCat("analysis failed at ", DescribeStep(plan, step), ": ",
                                             absl::StrJoin(failed, "; "));
        const std::string abort_later = " (fleet abort writes it once etcd answers)";
        absl::StatusOr<FleetView> now = ReadThroughLoss();
        if (!now.ok()) {
          return gave_up(now.status(),
                         absl::StrCat("; ", why, ": the rollback to ", ModeName(plan.stable_mode),
                                      " is not written", abort_later));
        }
        absl::StatusOr<DesiredState> back = WriteThroughLoss(
            *now, plan, -1, absl::StrCat("rollout ", plan.name, " aborted: ", why));
        if (!back.ok()) {
          return gave_up(back.status(),
                         absl::StrCat("; ", why, ": the rollback to ", ModeName(plan.stable_mode),
                                      " may not have landed", abort_later));
        }
        say_(absl::StrCat("  rolled back: generation ", back->generation, ", every node to ",
                          ModeName(plan.stable_mode)));
        return RunResult{RunResult::Outcome::kRolledBack, step, why};
      }
      const absl::Duration elapsed = absl::Now() - start;
      if (elapsed >= plan.step_duration) break;
      Pause(std::min(plan.analysis_interval, plan.step_duration - elapsed));
    }
    say_(absl::StrCat("  ", DescribeStep(plan, step), " passed its analysis for ",
                      Seconds(plan.step_duration)));
    if (step == last) {
      return RunResult{
          RunResult::Outcome::kComplete, step,
          absl::StrCat("rollout ", plan.name, " complete at ", DescribeStep(plan, step))};
    }
    view = ReadThroughLoss();
    if (!view.ok()) return gave_up(view.status(), resume);
  }
}

}  // namespace verifyd::fleet
