#pragma once
// Follows a fleet's desired state (desired_state.h). Consider() acts on the state's text from
// any source (etcd_source.h reads it from etcd); Start() follows it from a file, as Kubernetes
// mounts a ConfigMap: the kubelet swaps a symlink (..data) to a new directory, so the file's
// directory is watched (inotify) and the file read again whenever anything in it changes, and at
// least once a poll period. The node only proposes what the state asks of it (Propose: the mode
// controller, whose gate and probe may refuse); each generation is acted on once, so a node
// that rolled itself back is not flipped again until the fleet writes a new generation. A file
// that is missing, unreadable or not a valid state (one caught half written) changes nothing:
// the node keeps its mode, and the source is reported down until a valid state is read. The same
// holds for any source's error (etcd unreachable, the key deleted).

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/fleet/desired_state.h"

namespace verifyd::fleet {

struct FollowerOptions {
  std::string path;    // the desired-state file (Start); empty for another source
  std::string source;  // where the state comes from, when not a file (status, audit)
  std::string node;    // this node's name (the step's hash and node lists use it)
  std::string build;   // this verifyd's commit; a state for another build is refused
  absl::Duration poll = absl::Seconds(5);  // a look at least this often, events or not
};

// What the follower last saw and did.
struct FollowerStatus {
  bool source_up = false;        // the last look read a valid state
  std::string source_error;      // why not (empty when up)
  int64_t generation_seen = 0;   // the newest generation read
  int64_t generation_acted = 0;  // the newest generation proposed (or refused for its build)
  bool in_step = false;          // for that generation
  std::string last_outcome;      // "applied", "refused", "other_build"
  std::string last_detail;       // what was asked, and the refusal's reason
};

class FleetFollower {
 public:
  // Asks the node for `target` (the reason names the generation); OK when it took it, else the
  // refusal (the gate's FAILED_PRECONDITION).
  using Propose = std::function<absl::Status(const NodeTarget& target, const std::string& reason)>;
  // Called after each look, with the status then (metrics, log); for a look that proposes a mode,
  // also before the proposal, with acted false.
  using Observe = std::function<void(const FollowerStatus& status, bool acted)>;

  FleetFollower(FollowerOptions opts, Propose propose, Observe observe = nullptr);
  ~FleetFollower();  // stops the watch
  FleetFollower(const FleetFollower&) = delete;
  FleetFollower& operator=(const FleetFollower&) = delete;

  // Looks once, then watches in a thread of its own. A directory that cannot be watched (it
  // does not exist yet) is a source down, and is looked for again at every poll.
  absl::Status Start();
  // One look at the file now, in the caller's thread.
  void LookNow();
  // Acts on a desired state's text, or on its source's error (a source down: the mode is kept),
  // in the caller's thread, one call at a time; then tells observe.
  void Consider(absl::StatusOr<std::string> text);
  // The file's path, or the other source's description.
  const std::string& source() const { return opts_.path.empty() ? opts_.source : opts_.path; }
  FollowerStatus status() const;
  const FollowerOptions& options() const { return opts_; }

 private:
  void Watch();
  bool AddWatch();  // watches the file's directory unless it does already
  const FollowerOptions opts_;
  const Propose propose_;
  const Observe observe_;
  mutable absl::Mutex mu_;
  FollowerStatus status_ ABSL_GUARDED_BY(mu_);
  absl::Mutex look_mu_;                           // one Consider at a time
  std::string watch_error_ ABSL_GUARDED_BY(mu_);  // why the directory is not watched
  std::atomic<bool> watching_{false};             // set by Start, then by the watch thread
  int inotify_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: written to stop the watch
  std::thread watcher_;
};

}  // namespace verifyd::fleet
