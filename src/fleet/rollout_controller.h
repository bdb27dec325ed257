#pragma once
// The rollout controller behind `verifyctl fleet`: reads the fleet from etcd (PREFIX/desired and
// the nodes' status keys PREFIX/nodes/NODE), writes the desired state of each action with a new
// generation, and runs a plan step by step with its analysis (rollout_plan.h).
//
//   promote  the plan's next step (the first from any other state)
//   undo     the step before the current one (from the first: the stable state)
//   abort    the stable state on every node (the rollback)
//   run      from the current step (written anew, so that every node acts on it again) to the
//            last: each step waits until every node acted on its generation, then evaluates the
//            analysis every interval for the step's duration. A node that refused (once every
//            node acted) or did not act in time holds the rollout at its step; a query outside its
//            bounds (or that cannot be evaluated) aborts the rollout. A lost etcd (once the run
//            started) neither advances nor rolls back anything: the run waits for it, then goes on
//            where it was (a step's settle timeout counts only the time etcd answered). Lost for
//            longer than the controller's `etcd_lost_timeout`, the run gives up (kEtcdLost) and
//            writes nothing: the desired state stays as it was, the nodes keep their modes, and
//            another run goes on from that step.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/fleet/desired_state.h"
#include "src/fleet/etcd_client.h"
#include "src/fleet/rollout.h"
#include "src/fleet/rollout_plan.h"

namespace verifyd::fleet {

struct FleetView {
  std::optional<DesiredState> desired;
  std::string desired_error;  // a PREFIX/desired that does not parse
  int64_t desired_revision = 0;
  std::vector<NodeReport> nodes;
  std::vector<std::string> unreadable;  // "KEY: why", status keys that do not parse
};

struct RunResult {
  enum class Outcome { kComplete, kHeld, kRolledBack, kEtcdLost } outcome = Outcome::kComplete;
  int step = -1;       // the step reached (held at, rolled back from, or given up at)
  std::string detail;  // why it held, the failing query and its value, or which etcd was lost
};
const char* OutcomeName(RunResult::Outcome o);

class RolloutController {
 public:
  // `say` gets one line per event of a run (a step written, nodes acted, each analysis round).
  // A run waits at most `etcd_lost_timeout` for a lost etcd (infinite: as long as it takes).
  RolloutController(EtcdKv* kv, std::string prefix, std::function<void(const std::string&)> say,
                    absl::Duration etcd_lost_timeout = absl::InfiniteDuration());

  absl::StatusOr<FleetView> Read();
  // Writes step `index` of `plan` (-1: the stable state) with the next generation, unless the
  // desired state changed since `view` was read (ABORTED).
  absl::StatusOr<DesiredState> Write(const FleetView& view, const RolloutPlan& plan, int index,
                                     const std::string& reason);

  absl::StatusOr<DesiredState> Promote(const RolloutPlan& plan);
  absl::StatusOr<DesiredState> Undo(const RolloutPlan& plan);
  // `plan` may be absent: the stable mode is then the current desired state's (else shadow).
  absl::StatusOr<DesiredState> Abort(const std::optional<RolloutPlan>& plan,
                                     const std::string& why);
  // An error only when etcd fails otherwise than by being lost (or is not there at the start);
  // a held or rolled back rollout, and etcd lost past etcd_lost_timeout, are results.
  absl::StatusOr<RunResult> Run(const RolloutPlan& plan, const std::string& prometheus);

 private:
  // Read(), waiting while etcd is lost (UNAVAILABLE, DEADLINE_EXCEEDED) until it answers, or
  // UNAVAILABLE naming the endpoints once it was lost for etcd_lost_timeout; `lost` (if given)
  // gets how long that was.
  absl::StatusOr<FleetView> ReadThroughLoss(absl::Duration* lost = nullptr);
  // Write(), and when etcd was lost on the way, once it is back: written again if the key is
  // still `view`'s, the state itself if that write landed, else ABORTED (another writer);
  // UNAVAILABLE as ReadThroughLoss, saying that the write may have landed.
  absl::StatusOr<DesiredState> WriteThroughLoss(const FleetView& view, const RolloutPlan& plan,
                                                int index, const std::string& reason);
  // Waits until every node acted on `desired`: OK when none refused it, else FAILED_PRECONDITION
  // naming each refusal; FAILED_PRECONDITION naming the late nodes once settle_timeout passed.
  absl::Status Settle(const RolloutPlan& plan, const DesiredState& desired);
  // Every query once; the failing ones' details (empty: all passed).
  std::vector<std::string> Analyze(const RolloutPlan& plan, const std::string& prometheus);

  EtcdKv* const kv_;
  const std::string prefix_;  // without a trailing '/'
  const std::function<void(const std::string&)> say_;
  const absl::Duration etcd_lost_timeout_;
};

}  // namespace verifyd::fleet
