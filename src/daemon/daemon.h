#pragma once
// The whole daemon, wired: engine, mode controller, metrics, shadow runner, the data-plane and
// admin gRPC servers and /metrics. main() only parses flags into DaemonOptions; tests start it
// in-process on port 0.

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/channel/channel_server.h"
#include "src/common/admin_address.h"
#include "src/common/change_signal.h"
#include "src/common/malloc_arenas.h"
#include "src/compare/compare.h"
#include "src/control/mode_controller.h"
#include "src/daemon/state_dir_lock.h"
#include "src/engine/engine.h"
#include "src/engine/engine_factory.h"
#include "src/fleet/etcd_source.h"
#include "src/fleet/fleet_follower.h"
#include "src/metrics/metrics.h"
#include "src/probe/probe_scheduler.h"
#include "src/region/region_registry.h"
#include "src/server/runtime_facts.h"
#include "src/server/shadow_runner.h"
#include "src/server/verify_handler.h"
#include "src/server/verify_service.h"
#include "src/transport/unix_socket_acceptor.h"
#include "src/transport/vmm_fd_inbox.h"
#include "src/transport/vmm_fd_socket.h"

namespace grpc {
class Server;
class HealthCheckServiceInterface;
}  // namespace grpc

namespace verifyd {

class AdminServiceImpl;
class UnixSocketAcceptor;

// "verifyd VERSION (commit COMMIT)".
std::string DaemonVersion();

// TLS for the TCP listeners (data plane and admin); unix sockets stay plain. PEM text.
struct TlsOptions {
  std::string cert_chain, private_key;  // both empty: TCP is plaintext
  std::string client_ca;                // non-empty: clients must present a certificate from it
  bool enabled() const { return !cert_chain.empty(); }
};

struct DaemonOptions {
  std::vector<std::string> listen = {kDefaultDataAddress};  // HOST:PORT or unix:PATH
  std::string admin_listen = kDefaultAdminAddress;
  std::string admin_token;          // required for a TCP admin listener
  bool insecure_admin_tcp = false;  // allow the token over a TCP admin listener without TLS
  TlsOptions tls;
  // The data plane's Unix sockets: who may connect (0660: the daemon's user and group).
  SocketAccess data_socket{0660, ""};
  std::string metrics_address = "127.0.0.1:9464";  // empty: no /metrics
  // The systemd unit's StateDirectory: an absolute default, never a folder in whatever directory
  // verifyd happens to start in.
  std::string state_dir = "/var/lib/verifyd";
  EngineOptions engine;
  // Transport limits: VerifyServiceOptions holds their defaults.
  int64_t max_message_bytes = VerifyServiceOptions{}.max_message_bytes;
  // gRPC ceilings of the data plane: threads serving calls (a call or stream beyond them is
  // answered RESOURCE_EXHAUSTED) and concurrent streams per connection.
  int grpc_max_threads = 128;
  int grpc_max_concurrent_streams = 256;
  // Streams open at once (below grpc_max_threads: the rest serve unary calls) and their idle
  // timeout.
  StreamLimits streams;
  int64_t max_inflight_bytes = VerifyServiceOptions{}.max_inflight_bytes;  // 0 = no budget
  double inflight_peer_share = VerifyServiceOptions{}.inflight_peer_share;
  uint64_t pinned_receive_bytes = VerifyServiceOptions{}.receive_keep_bytes;
  int64_t keep_freed_bytes = kDefaultKeepFreedMb << 20;  // KeepFreedMemory() (main applies it)
  ControllerOptions controller;
  HandlerOptions handler;
  int shadow_threads = 1;
  int shadow_queue = 64;
  double shadow_sample_rate = -1;  // >= 0 sets (and persists) the rate at start
  double custom_sample_rate = -1;
  CaptureOptions capture;           // capture.dir empty: capture off
  RegionLimits regions;             // max_regions 0: no regions are served
  bool allow_region_tcp = false;    // serve regions (and call channels) over TCP too
  ChannelLimits channels;           // max_channels 0: no call channels
  CustomFault inject_custom_fault;  // test only
  ProbeOptions probe;               // probe.at_start off: no start-up probe, the gate needs none
  // A fleet's desired state to follow (src/fleet/): the file a ConfigMap is mounted as, or etcd's
  // endpoints (host:port) and the prefix of its keys; neither: none. The node's name for the
  // state's steps and its status key (empty: the host name).
  std::string fleet_file;
  std::vector<std::string> fleet_etcd;
  std::string fleet_etcd_prefix = "/verifyd/fleet";
  std::string node_name;
};

// What GetStatus reports of `o` (RuntimeFacts), with the addresses as bound; started = now.
RuntimeFacts RuntimeFactsOf(const DaemonOptions& o, std::vector<std::string> listen,
                            std::string metrics_address);

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonOptions opts);
  ~Daemon();

  // Bound addresses, port 0 resolved ("127.0.0.1:41234", "unix:/tmp/x.sock").
  const std::vector<std::string>& listen_addresses() const { return listen_addresses_; }
  const std::string& admin_address() const { return admin_address_; }
  int metrics_port() const;

  // Blocks until Shutdown() is called or the engine faulted. Returns the exit code.
  int Wait();
  void Shutdown();
  // Marks health NOT_SERVING, records the fault so a restart comes back in shadow, and makes
  // Wait() return non-zero.
  void OnFatal(const absl::Status& st);

  ModeController& controller() { return *controller_; }
  ShadowRunner& shadow() { return *shadow_; }
  Engine& engine() { return *engine_; }
  VerifyHandler& handler() { return *handler_; }
  VerifyServiceImpl& verify_service() { return *verify_service_; }
  Metrics& metrics() { return *metrics_; }
  Capturer* capturer() { return capturer_.get(); }

 private:
  Daemon() = default;
  // Start's stages, in order.
  absl::Status StartEngineAndState();  // state dir lock, listeners, engine, metrics, controller
  absl::Status StartCalls();           // probes, shadow runner, handler, regions
  absl::Status StartDataPlane();       // the data-plane gRPC server and its Unix sockets
  absl::Status StartAdmin();           // the admin gRPC server
  absl::Status StartFleet();  // the fleet's desired state, followed (--fleet_file, --fleet_etcd)
  void LogStarted() const;
  // Makes host memory readable by the engine's devices (regions, channels, receive buffers).
  RegionRegistry::HostPinner HostPinner() const;
  // Counts, logs and audits a peer refused another's region or channel.
  DenialObserver DenialReporter() const;

  DaemonOptions opts_;
  EngineInfo info_;
  BuildInfo build_;
  std::unique_ptr<StateDirLock> state_lock_;  // first member: released last
  std::atomic<bool> ready_{false};            // /readyz: serving, engine up and mode loaded
  ChangeSignal mode_changes_;                 // each change of the mode (switch channels)
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ModeController> controller_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<MetricsServer> metrics_server_;
  std::unique_ptr<Capturer> capturer_;
  std::unique_ptr<RegionRegistry> regions_;  // after the engine (which unmaps CUDA regions)
  std::unique_ptr<VmmFdInbox> vmm_fds_;      // descriptors for RegisterCudaVmmRegion
  std::unique_ptr<ShadowRunner> shadow_;
  std::unique_ptr<VerifyHandler> handler_;
  std::unique_ptr<VerifyServiceImpl> verify_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Server> data_server_, admin_server_;
  std::vector<std::unique_ptr<UnixSocketAcceptor>> data_acceptors_;  // the unix: listeners
  std::unique_ptr<UnixSocketAcceptor> admin_acceptor_;               // a unix: admin_listen
  std::vector<std::unique_ptr<VmmFdSocket>> vmm_fd_sockets_;  // PATH.fds of each unix: listener
  std::unique_ptr<fleet::FleetFollower> fleet_;               // --fleet_file or --fleet_etcd
  std::unique_ptr<fleet::EtcdSource> fleet_etcd_;             // --fleet_etcd: fleet_'s source
  std::unique_ptr<ProbeScheduler> probes_;                    // last member: stopped first
  std::vector<std::string> listen_addresses_;
  std::string admin_address_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int exit_code_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace verifyd
