#pragma once
// verifyd.v1.AdminService: status and mode changes. On TCP every call must carry
// "authorization: Bearer <token>"; on the default Unix socket the file mode (0600) guards it.
// Every mode change records who the client claims to be and who the daemon verified: the
// kernel's uid of a Unix-socket client, or the token's identity on TCP.

#include <chrono>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "src/capture/capturer.h"
#include "src/channel/channel_server.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/fleet/fleet_follower.h"
#include "src/metrics/metrics.h"
#include "src/probe/probe_scheduler.h"
#include "src/region/region_registry.h"
#include "src/server/runtime_facts.h"
#include "verifyd/v1/admin.grpc.pb.h"

namespace verifyd {

struct AdminContext {
  ModeController* controller = nullptr;
  Metrics* metrics = nullptr;
  EngineInfo engine;
  BuildInfo build;
  RuntimeFacts runtime;
  std::string token;                            // empty: no token required
  Capturer* capturer = nullptr;                 // null: capture off
  const RegionRegistry* regions = nullptr;      // null: no regions
  const ChannelServer* channels = nullptr;      // null: no call channels
  const fleet::FleetFollower* fleet = nullptr;  // null: no --fleet_file nor --fleet_etcd
  ProbeScheduler* probes = nullptr;             // null: RunProbes is unavailable
  // Request counters, owned by the daemon.
  std::function<v1::Counters()> counters;
  // Failed authentications are logged at most once per this interval (the rest are counted).
  std::chrono::steady_clock::duration auth_log_interval = std::chrono::seconds(10);
};

// "token:" and the first 8 hex digits of the token's SHA-256: names a token without revealing it.
std::string TokenIdentity(const std::string& token);

class AdminServiceImpl final : public v1::AdminService::Service {
 public:
  explicit AdminServiceImpl(AdminContext ctx);

  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* req,
                         v1::GetStatusResponse* resp) override;
  grpc::Status SetMode(grpc::ServerContext* ctx, const v1::SetModeRequest* req,
                       v1::SetModeResponse* resp) override;
  grpc::Status SetSampling(grpc::ServerContext* ctx, const v1::SetSamplingRequest* req,
                           v1::SetSamplingResponse* resp) override;
  grpc::Status Capture(grpc::ServerContext* ctx, const v1::CaptureRequest* req,
                       v1::CaptureResponse* resp) override;
  grpc::Status RunProbes(grpc::ServerContext* ctx, const v1::RunProbesRequest* req,
                         v1::RunProbesResponse* resp) override;

 private:
  grpc::Status Authorize(grpc::ServerContext* ctx);
  // Counts a failed authentication and logs it, rate-limited.
  void AuthFailed(const grpc::ServerContext& ctx, const std::string& why);
  // The verified identity of the caller (after Authorize).
  std::string Peer(const grpc::ServerContext& ctx) const;

  const AdminContext ctx_;
  const std::string token_identity_;  // empty without a token
  absl::Mutex auth_log_mu_;
  std::chrono::steady_clock::time_point last_auth_log_ ABSL_GUARDED_BY(auth_log_mu_);
  int64_t auth_log_suppressed_ ABSL_GUARDED_BY(auth_log_mu_) = 0;
};

}  // namespace verifyd
