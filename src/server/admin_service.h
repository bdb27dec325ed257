#pragma once
// verifyd.v1.AdminService: status and mode changes. On TCP every call must carry
// "authorization: Bearer <token>"; on the default Unix socket the file mode (0600) guards it.

#include <string>

#include "src/capture/capturer.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/metrics/metrics.h"
#include "verifyd/v1/admin.grpc.pb.h"

namespace verifyd {

struct AdminContext {
  ModeController* controller = nullptr;
  Metrics* metrics = nullptr;
  EngineInfo engine;
  BuildInfo build;
  std::string token;  // empty: no token required
  Capturer* capturer = nullptr;  // null: capture off
  // Request counters, owned by the daemon.
  std::function<v1::Counters()> counters;
};

class AdminServiceImpl final : public v1::AdminService::Service {
 public:
  explicit AdminServiceImpl(AdminContext ctx) : ctx_(std::move(ctx)) {}

  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* req,
                         v1::GetStatusResponse* resp) override;
  grpc::Status SetMode(grpc::ServerContext* ctx, const v1::SetModeRequest* req,
                       v1::SetModeResponse* resp) override;
  grpc::Status SetSampling(grpc::ServerContext* ctx, const v1::SetSamplingRequest* req,
                           v1::SetSamplingResponse* resp) override;
  grpc::Status Capture(grpc::ServerContext* ctx, const v1::CaptureRequest* req,
                       v1::CaptureResponse* resp) override;

 private:
  grpc::Status Authorize(grpc::ServerContext* ctx) const;
  AdminContext ctx_;
};

}  // namespace verifyd
