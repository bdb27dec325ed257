#include "src/server/daemon.h"

#include <sys/stat.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "spdlog/spdlog.h"
#include "src/server/admin_service.h"
#include "src/server/verify_service.h"

#ifndef VERIFYD_VERSION
#define VERIFYD_VERSION "0.0.0"
#endif
#ifndef VERIFYD_GIT_COMMIT
#define VERIFYD_GIT_COMMIT "unknown"
#endif

namespace verifyd {
namespace {

constexpr char kServiceName[] = "verifyd.v1.VerifyService";

bool IsUnix(const std::string& a) { return absl::StartsWith(a, "unix:"); }

// Resolves port 0 to the bound port for logs and tests.
std::string Bound(const std::string& addr, int port) {
  if (IsUnix(addr)) return addr;
  const size_t colon = addr.rfind(':');
  return absl::StrCat(addr.substr(0, colon), ":", port);
}

// What shapes the custom path's output and the gate's verdicts: state.json binds a flip and the
// gate's evidence to it (with the version and commit).
std::string CustomConfigDescription(const EngineInfo& info, const DaemonOptions& o) {
  const Tolerance& t = o.handler.tolerance;
  return absl::StrCat("engine=", info.engine, ";cc=", info.compute_capability,
                      ";fault=", static_cast<int>(o.inject_custom_fault.kind), ":",
                      o.inject_custom_fault.amount, ";tol=", t.atol, ",", t.rtol, ",",
                      t.max_rel_l2, ",", t.max_abs, ",", t.max_lse_abs, ",", t.max_beyond_tol,
                      ";custom_timeout=", o.handler.custom_timeout_seconds);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions opts) {
  std::unique_ptr<Daemon> d(new Daemon);
  d->opts_ = opts;
  if (!IsUnix(opts.admin_listen) && !opts.admin_listen.empty() && opts.admin_token.empty()) {
    return absl::InvalidArgumentError(
        "admin_listen: a TCP admin listener needs --admin_token_file (or use unix:PATH)");
  }

  absl::StatusOr<std::unique_ptr<Engine>> engine = MakeEngine(opts.engine);
  if (!engine.ok()) return engine.status();
  d->engine_ = std::move(*engine);
  if (opts.inject_custom_fault.kind != CustomFault::Kind::kNone) {
    spdlog::warn("test-only fault injection into the custom path is on");
    d->engine_->InjectCustomFault(opts.inject_custom_fault);
  }
  const EngineInfo info = d->engine_->Info();

  BuildInfo build{VERIFYD_VERSION, VERIFYD_GIT_COMMIT, info.engine, info.device,
                  info.compute_capability};
  d->metrics_ = std::make_unique<Metrics>(build);
  Metrics* metrics = d->metrics_.get();

  absl::StatusOr<StateStore> store = StateStore::Open(opts.state_dir);
  if (!store.ok()) return store.status();
  ControllerOptions copts = opts.controller;
  copts.build = {VERIFYD_VERSION, VERIFYD_GIT_COMMIT,
                 ConfigFingerprint(CustomConfigDescription(info, opts))};
  copts.on_rollback = [metrics](std::string_view reason) { metrics->Rollback(reason); };
  copts.on_change = [metrics](const PersistedState& s, const GateStatus& g) {
    metrics->SetMode(s.mode, s.canary_fraction);
    metrics->SetGate(g);
  };
  auto controller = ModeController::Create(std::move(*store), std::move(copts));
  if (!controller.ok()) return controller.status();
  d->controller_ = std::move(*controller);
  for (auto [mode, rate] : {std::pair{Mode::kShadow, opts.shadow_sample_rate},
                            std::pair{Mode::kCustom, opts.custom_sample_rate}}) {
    if (rate < 0) continue;
    if (absl::Status st = d->controller_->ApplySampleRateFlag(mode, rate); !st.ok()) return st;
  }

  const ControllerSnapshot snap = d->controller_->Snapshot();
  d->metrics_->SetMode(snap.state.mode, snap.state.canary_fraction);
  d->metrics_->SetGate(snap.gate);
  if (!opts.metrics_address.empty()) {
    auto ms = MetricsServer::Start(opts.metrics_address, d->metrics_->registry());
    if (!ms.ok()) return ms.status();
    d->metrics_server_ = std::move(*ms);
  }

  if (!opts.capture.dir.empty()) {
    auto cap = Capturer::Create(opts.capture, absl::StrCat("verifyd ", build.version, " (",
                                                           build.commit, ") ", info.engine, " ",
                                                           info.device));
    if (!cap.ok()) return cap.status();
    d->capturer_ = std::move(*cap);
  }
  d->shadow_ = std::make_unique<ShadowRunner>(opts.shadow_threads, opts.shadow_queue);
  Daemon* self = d.get();
  d->handler_ = std::make_unique<VerifyHandler>(
      d->engine_.get(), d->controller_.get(), d->metrics_.get(), d->shadow_.get(), opts.handler,
      [self](const absl::Status& st) { self->OnFatal(st); });
  d->handler_->SetCapturer(d->capturer_.get());

  // Data plane.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  d->verify_service_ = std::make_unique<VerifyServiceImpl>(
      d->handler_.get(), d->metrics_.get(),
      VerifyServiceOptions{opts.max_message_bytes, opts.max_inflight_bytes});
  {
    grpc::ServerBuilder b;
    std::vector<int> ports(opts.listen.size(), 0);
    for (size_t i = 0; i < opts.listen.size(); ++i) {
      if (IsUnix(opts.listen[i])) {
        std::error_code ec;
        std::filesystem::remove(opts.listen[i].substr(5), ec);  // a stale socket from a crash
      }
      b.AddListeningPort(opts.listen[i], grpc::InsecureServerCredentials(), &ports[i]);
    }
    const int max_bytes = static_cast<int>(std::min<int64_t>(opts.max_message_bytes, INT32_MAX));
    b.SetMaxReceiveMessageSize(-1);  // the verify service refuses (and counts) larger ones
    b.SetMaxSendMessageSize(max_bytes);
    b.RegisterService(d->verify_service_.get());
    d->data_server_ = b.BuildAndStart();
    if (!d->data_server_) {
      return absl::UnavailableError(absl::StrCat(
          "listen: could not bind ", absl::StrJoin(opts.listen, ", "), " (in use?)"));
    }
    for (size_t i = 0; i < opts.listen.size(); ++i) {
      if (!IsUnix(opts.listen[i]) && ports[i] == 0) {
        return absl::UnavailableError(absl::StrCat("listen: could not bind ", opts.listen[i]));
      }
      d->listen_addresses_.push_back(Bound(opts.listen[i], ports[i]));
    }
    d->data_server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
    d->data_server_->GetHealthCheckService()->SetServingStatus("", true);
  }

  // Admin.
  if (!opts.admin_listen.empty()) {
    AdminContext actx;
    actx.controller = d->controller_.get();
    actx.metrics = d->metrics_.get();
    actx.engine = info;
    actx.build = build;
    actx.capturer = d->capturer_.get();
    actx.counters = [self] { return self->handler_->counters(); };
    actx.token = IsUnix(opts.admin_listen) ? "" : opts.admin_token;
    d->admin_service_ = std::make_unique<AdminServiceImpl>(std::move(actx));
    grpc::ServerBuilder b;
    int port = 0;
    if (IsUnix(opts.admin_listen)) {
      std::error_code ec;
      std::filesystem::remove(opts.admin_listen.substr(5), ec);  // a stale socket from a crash
    }
    b.AddListeningPort(opts.admin_listen, grpc::InsecureServerCredentials(), &port);
    b.RegisterService(d->admin_service_.get());
    d->admin_server_ = b.BuildAndStart();
    if (!d->admin_server_ || (!IsUnix(opts.admin_listen) && port == 0)) {
      return absl::UnavailableError(absl::StrCat("admin_listen: could not bind ",
                                                 opts.admin_listen));
    }
    if (IsUnix(opts.admin_listen)) {
      ::chmod(opts.admin_listen.substr(5).c_str(), 0600);
    }
    d->admin_address_ = Bound(opts.admin_listen, port);
  }

  spdlog::info("verifyd {} ({}) engine {} on {}{}", build.version, build.commit, info.engine,
               info.device,
               info.compute_capability.empty()
                   ? ""
                   : absl::StrCat(", ", info.sm_count, " SMs, sm_", info.compute_capability));
  spdlog::info("data plane on {}", absl::StrJoin(d->listen_addresses_, ", "));
  if (!d->admin_address_.empty()) spdlog::info("admin on {}", d->admin_address_);
  if (d->metrics_server_) {
    spdlog::info("metrics on http://{}/metrics", Bound(opts.metrics_address, d->metrics_port()));
  }
  spdlog::info("mode {}, state in {}, captures {}", ModeName(snap.state.mode), opts.state_dir,
               opts.capture.dir.empty() ? "off" : opts.capture.dir);
  return d;
}

int Daemon::metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }

void Daemon::OnFatal(const absl::Status& st) {
  {
    absl::MutexLock l(&mu_);
    if (exit_code_ != 0) return;
    exit_code_ = 3;
    stopping_ = true;
  }
  if (data_server_) {
    data_server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
    data_server_->GetHealthCheckService()->SetServingStatus("", false);
  }
  absl::Status rec = controller_->MarkCustomFaulted(std::string(st.message()));
  spdlog::critical("custom path faulted: {}; health is NOT_SERVING, state {}; exiting",
                   st.ToString(), rec.ok() ? "recorded" : rec.ToString());
}

int Daemon::Wait() {
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(&stopping_));
  return exit_code_;
}

void Daemon::Shutdown() {
  absl::MutexLock l(&mu_);
  stopping_ = true;
}

Daemon::~Daemon() {
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
  if (data_server_) data_server_->Shutdown(deadline);
  if (admin_server_) admin_server_->Shutdown(deadline);
  shadow_.reset();  // finishes queued comparisons while the engine still exists
  if (controller_) {
    if (absl::Status st = controller_->Flush(); !st.ok()) {
      spdlog::error("gate evidence not saved at shutdown: {}", st.ToString());
    }
  }
}

}  // namespace verifyd
