#pragma once
// Follows a fleet's desired state from etcd (the v3 gRPC API, proto/etcd/), and reports this
// node's status back to it.
//
//   PREFIX/desired       the desired state (desired_state.h), written by the rollout controller
//   PREFIX/nodes/NODE    this node's status, JSON, under a lease of its own (TTL 15 s, kept
//                        alive): a node that dies leaves no key behind once the lease runs out
//
// The key is read once (Range), then watched from the next revision; every value goes to the
// follower (FleetFollower::Consider), which acts on each generation once. A lost connection, a
// cancelled watch or a deleted key is a source down: the node keeps its mode, and the follower's
// status (source_up, source_error) says why. The source then connects again (the next endpoint,
// a backoff of at most a second) and reads the key anew, so that a generation written while it
// was away is acted on.
//
// The status is Put at start, after each value considered and every report period: mode and
// canary fraction, gate (open or closed), the generations seen and acted on, the last outcome
// and its detail (a refusal's reason), the source's state, build and time.
//
// The connection is plain gRPC without TLS or authentication (etcd_client.h).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/fleet/etcd_client.h"
#include "src/fleet/fleet_follower.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace verifyd::fleet {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // host:port, tried in turn
  std::string prefix = "/verifyd/fleet";
  std::string node;   // this node's name: its status key
  std::string build;  // this verifyd's commit, reported
  absl::Duration report_period = absl::Seconds(5);
  int64_t lease_ttl_seconds = 15;
  absl::Duration max_backoff = absl::Seconds(1);  // between attempts to connect
  absl::Duration rpc_timeout = absl::Seconds(2);  // each unary call
};

// What the node serves, for its status key (the daemon's: ModeController::Snapshot()).
struct NodeState {
  std::string mode;  // ModeName
  double canary_fraction = 0;
  bool gate_open = false;
  std::string gate_reason;
};

// A node's status key's JSON (see above); `time` is RFC 3339.
std::string NodeStatusJson(const std::string& node, const std::string& build,
                           const NodeState& state, const FollowerStatus& f,
                           const std::string& time);

class EtcdSource {
 public:
  using NodeStateFn = std::function<NodeState()>;

  // `follower` (not started: this is its source) and `node_state` outlive the source.
  EtcdSource(EtcdOptions opts, FleetFollower* follower, NodeStateFn node_state);
  // Stops both threads and revokes the status key's lease (the key goes with it).
  ~EtcdSource();
  EtcdSource(const EtcdSource&) = delete;
  EtcdSource& operator=(const EtcdSource&) = delete;

  // Starts following and reporting, each in a thread of its own; an etcd not reachable yet is
  // a source down, and is tried again.
  void Start();
  // Asks for a status report now (it is also made after each value, and every period).
  void ReportNow();

  std::string desired_key() const { return prefix_ + "/desired"; }
  std::string node_key() const { return prefix_ + "/nodes/" + opts_.node; }
  // "etcd ENDPOINT PREFIX/desired", the endpoint in use now (audit peers, logs).
  std::string Describe() const;
  // The lease the status key is Put under; 0: none yet.
  int64_t lease_id() const { return lease_id_.load(); }

 private:
  void Follow();
  // Reads the key, then watches it until the stream ends; the reason it ended.
  absl::Status FollowOnce(const std::shared_ptr<grpc::Channel>& channel, bool* connected);
  void Reports();
  absl::Status ReportOnce();
  absl::Status KeepLease(const std::shared_ptr<grpc::Channel>& channel);
  std::shared_ptr<grpc::Channel> CurrentChannel() const;
  // Cancellation at stop: a call's context is registered while it runs. False: stopping.
  bool Register(grpc::ClientContext* ctx);
  void Unregister(grpc::ClientContext* ctx);
  // Waits `d`, or less when stopping (true then) or a report is asked for.
  bool Sleep(absl::Duration d, bool wake_on_report);

  const EtcdOptions opts_;
  const std::string prefix_;  // without a trailing '/'
  FleetFollower* const follower_;
  const NodeStateFn node_state_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // one per endpoint
  std::atomic<size_t> current_{0};                        // the endpoint in use
  std::atomic<int64_t> lease_id_{0};                      // the report thread's
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool report_asked_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
  std::thread follower_thread_, report_thread_;
};

}  // namespace verifyd::fleet
