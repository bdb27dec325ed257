#include "src/daemon/daemon.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <memory>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "spdlog/spdlog.h"
#include "src/common/build_version.h"
#include "src/common/host_name.h"
#include "src/common/status_macros.h"
#include "src/server/admin_service.h"
#include "src/server/runtime_facts.h"
#include "src/server/verify_service.h"
#include "src/transport/listen_address.h"
#include "src/transport/unix_socket_acceptor.h"

namespace verifyd {
namespace {

constexpr char kServiceName[] = "verifyd.v1.VerifyService";

// A channel's request area holds one message: at most what the data plane takes.
ChannelLimits ChannelLimitsFor(const DaemonOptions& opts) {
  ChannelLimits c = opts.channels;
  c.max_capacity = static_cast<uint64_t>(opts.max_message_bytes);
  return c;
}

// Before anything starts: every address must be free (a unix:PATH listener may replace only a
// stale socket), so that a second daemon fails fast and touches nothing of the first.
absl::Status PrepareListeners(const DaemonOptions& opts) {
  auto prepare = [](const char* flag, const std::string& a) {
    return IsUnixAddress(a) ? PrepareUnixSocketPath(flag, a.substr(5))
                            : CheckTcpAddressFree(flag, a);
  };
  for (const std::string& a : opts.listen) {
    VERIFYD_RETURN_IF_ERROR(prepare("listen", a));
    // The descriptor socket next to a Unix data socket, where regions are served.
    const std::string fds = IsUnixAddress(a) ? VmmFdSocket::PathFor(a.substr(5)) : "";
    if (opts.regions.max_regions > 0 && VmmFdSocket::PathFits(fds)) {
      VERIFYD_RETURN_IF_ERROR(PrepareUnixSocketPath("listen", fds));
    }
  }
  if (!opts.admin_listen.empty()) {
    VERIFYD_RETURN_IF_ERROR(prepare("admin_listen", opts.admin_listen));
  }
  if (!opts.metrics_address.empty()) {
    VERIFYD_RETURN_IF_ERROR(CheckTcpAddressFree("metrics_address", opts.metrics_address));
  }
  return absl::OkStatus();
}

// The credentials of one listener: TLS on TCP when configured, else plaintext.
std::shared_ptr<grpc::ServerCredentials> ListenerCredentials(const std::string& address,
                                                             const TlsOptions& tls) {
  if (IsUnixAddress(address) || !tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      tls.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = tls.client_ca;
  ssl.pem_key_cert_pairs.push_back({tls.private_key, tls.cert_chain});
  return grpc::SslServerCredentials(ssl);
}

// The TLS certificate and key, checked before anything slow starts (the engine, the start-up
// probe suite): each must parse, and the key must be the certificate's. gRPC would find a bad pair
// only when the servers bind, after the probe suite.
absl::Status CheckTlsPair(const TlsOptions& tls) {
  if (!tls.enabled()) return absl::OkStatus();
  // No passphrase prompt on the terminal for an encrypted key: it does not parse.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return 0; };
  auto read = [](const std::string& pem) {
    return std::unique_ptr<BIO, decltype(&BIO_free)>(
        BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  };
  const bool swapped = tls.cert_chain.find("PRIVATE KEY-----") != std::string::npos &&
                       tls.private_key.find("CERTIFICATE-----") != std::string::npos;
  const char* check = swapped ? " (--tls_cert_file and --tls_key_file are swapped)"
                              : " (check that --tls_key_file is the key of --tls_cert_file)";
  auto cert_bio = read(tls.cert_chain);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, no_passphrase, nullptr), &X509_free);
  auto key_bio = read(tls.private_key);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr), &EVP_PKEY_free);
  const bool match = cert && key && X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();  // gRPC reads OpenSSL's error queue of this thread later
  if (!cert) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_cert_file: holds no PEM certificate", check));
  }
  if (!key) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key_file: holds no unencrypted PEM private key", check));
  }
  if (!match) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key_file: not the key of the certificate in --tls_cert_file", check));
  }
  return absl::OkStatus();
}

// Why a server did not start: a taken port, or else TLS credentials gRPC refused.
std::string StartFailure(const std::vector<std::string>& addresses, const TlsOptions& tls) {
  std::string why = BindFailure(addresses);
  if (tls.enabled() && absl::StartsWith(why, "could not bind")) {
    absl::StrAppend(&why, " (check that --tls_key_file is the key of --tls_cert_file)");
  }
  return why;
}

// Exclusive binds (without this gRPC sets SO_REUSEPORT and a second daemon shares the port) and
// the ceilings on threads and streams.
void ConfigureServer(grpc::ServerBuilder& b, const std::string& name, int max_threads,
                     int max_streams) {
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_streams);
  grpc::ResourceQuota quota(name);
  quota.SetMaxThreads(max_threads);
  b.SetResourceQuota(quota);
}

// The admin API's own ceilings: a flooded data plane cannot take its threads.
constexpr int kAdminMaxThreads = 8;
constexpr int kAdminMaxStreams = 16;

// Resolves port 0 to the bound port for logs and tests.
std::string Bound(const std::string& addr, int port) {
  if (IsUnixAddress(addr)) return addr;
  const size_t colon = addr.rfind(':');
  return absl::StrCat(addr.substr(0, colon), ":", port);
}

// What shapes the custom path's output and the gate's verdicts: state.json binds a flip and the
// gate's evidence to it (with the version and commit). The test-only fault injection is left
// out: it stands for a kernel that goes wrong under an approved configuration.
std::string CustomConfigDescription(const EngineInfo& info, const DaemonOptions& o) {
  const Tolerance& t = o.handler.tolerance;
  return absl::StrCat("engine=", info.engine, ";cc=", info.compute_capability, ";tol=", t.atol, ",",
                      t.rtol, ",", t.max_rel_l2, ",", t.max_abs, ",", t.max_lse_abs, ",",
                      t.max_beyond_tol, ",", t.atol_rel, ",", t.max_row_rel_l2,
                      ";custom_timeout=", o.handler.custom_timeout_seconds);
}

absl::Status CheckAdminListener(const DaemonOptions& opts) {
  if (!IsUnixAddress(opts.admin_listen) && !opts.admin_listen.empty()) {
    if (opts.admin_token.empty()) {
      return absl::InvalidArgumentError(
          "admin_listen: a TCP admin listener needs --admin_token_file (or use unix:PATH)");
    }
    if (!opts.tls.enabled() && !opts.insecure_admin_tcp) {
      return absl::InvalidArgumentError(
          absl::StrCat("admin_listen: ", opts.admin_listen,
                       " is TCP without TLS and the admin token would travel in clear; give "
                       "--tls_cert_file and --tls_key_file, use unix:PATH, or accept it with "
                       "--insecure_admin_tcp"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string DaemonVersion() {
  return absl::StrCat("verifyd ", VERIFYD_VERSION, " (commit ", VERIFYD_GIT_COMMIT, ")");
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions opts) {
  VERIFYD_RETURN_IF_ERROR(CheckAdminListener(opts));
  VERIFYD_RETURN_IF_ERROR(CheckTlsPair(opts.tls));
  std::unique_ptr<Daemon> d(new Daemon);
  d->opts_ = std::move(opts);
  VERIFYD_RETURN_IF_ERROR(d->StartEngineAndState());
  VERIFYD_RETURN_IF_ERROR(d->StartCalls());
  VERIFYD_RETURN_IF_ERROR(d->StartDataPlane());
  VERIFYD_RETURN_IF_ERROR(d->StartFleet());
  VERIFYD_RETURN_IF_ERROR(d->StartAdmin());
  d->LogStarted();
  d->ready_ = true;
  return d;
}

absl::Status Daemon::StartEngineAndState() {
  const DaemonOptions& opts = opts_;
  // One daemon per state dir and per address: refuse before touching anything the other uses.
  VERIFYD_ASSIGN_OR_RETURN(state_lock_, StateDirLock::Acquire(opts.state_dir));
  VERIFYD_RETURN_IF_ERROR(PrepareListeners(opts));

  std::string cpu_fallback;
  absl::StatusOr<std::unique_ptr<Engine>> engine = MakeEngine(opts.engine, &cpu_fallback);
  if (!engine.ok()) return engine.status();
  engine_ = std::move(*engine);
  if (opts.inject_custom_fault.kind != CustomFault::Kind::kNone) {
    spdlog::warn("test-only fault injection into the custom path is on");
    engine_->InjectCustomFault(opts.inject_custom_fault);
  }
  const EngineInfo info = engine_->Info();
  if (opts.inject_custom_fault.kind == CustomFault::Kind::kBf16Pv && info.engine != "cpu") {
    return absl::InvalidArgumentError("inject_custom_fault: bf16_pv needs the CPU engine");
  }

  BuildInfo build{VERIFYD_VERSION, VERIFYD_GIT_COMMIT,      info.engine,
                  info.device,     info.compute_capability, cpu_fallback};
  if (!cpu_fallback.empty()) {
    spdlog::warn("engine: {} (verifyd_engine_cpu_fallback is 1)", cpu_fallback);
  }
  info_ = info;
  build_ = build;
  metrics_ = std::make_unique<Metrics>(build);
  Metrics* metrics = metrics_.get();

  absl::StatusOr<StateStore> store = StateStore::Open(opts.state_dir);
  if (!store.ok()) return store.status();
  ControllerOptions copts = opts.controller;
  copts.build = {VERIFYD_VERSION, VERIFYD_GIT_COMMIT,
                 ConfigFingerprint(CustomConfigDescription(info, opts))};
  copts.on_rollback = [metrics](std::string_view reason) { metrics->Rollback(reason); };
  copts.on_drift = [metrics](const DriftReading& r, bool b) { metrics->Drift(r, b); };
  copts.require_probe = opts.probe.at_start;
  copts.on_audit = [metrics](const AuditEntry& e) { metrics->LastChange(e); };
  copts.on_change = [metrics, changes = &mode_changes_](const PersistedState& s,
                                                        const GateStatus& g) {
    metrics->SetMode(s.mode, s.canary_fraction);
    metrics->SetGate(g);
    changes->Notify();
  };
  auto controller = ModeController::Create(std::move(*store), std::move(copts));
  if (!controller.ok()) return controller.status();
  controller_ = std::move(*controller);
  // A lost device, whoever meets it first (a call, the shadow runner, a probe), stops the daemon.
  engine_->SetDeviceLostHandler([this](const absl::Status& st) { OnFatal(st); });
  for (auto [mode, rate] : {std::pair{Mode::kShadow, opts.shadow_sample_rate},
                            std::pair{Mode::kCustom, opts.custom_sample_rate}}) {
    if (rate < 0) continue;
    if (absl::Status st = controller_->ApplySampleRateFlag(mode, rate); !st.ok()) return st;
  }

  if (!opts.metrics_address.empty()) {
    auto ms = MetricsServer::Start(opts.metrics_address, metrics_->registry(),
                                   [this] { return ready_.load(); });
    if (absl::IsUnavailable(ms.status())) {
      return absl::UnavailableError(
          absl::StrCat("metrics_address: ", BindFailure({opts.metrics_address})));
    }
    if (!ms.ok()) return ms.status();
    metrics_server_ = std::move(*ms);
  }

  if (!opts.capture.dir.empty()) {
    auto cap =
        Capturer::Create(opts.capture, absl::StrCat("verifyd ", build.version, " (", build.commit,
                                                    ") ", info.engine, " ", info.device));
    if (!cap.ok()) return cap.status();
    capturer_ = std::move(*cap);
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartCalls() {
  const DaemonOptions& opts = opts_;
  const EngineInfo& info = info_;
  // The probe suite: at start-up before anything is served (the gate needs it to pass), then
  // every --probe_interval while canary/custom is served.
  ProbeOptions probe = opts.probe;
  if (probe.suite.max_prefix == 0) probe.suite.max_prefix = DefaultProbeMaxPrefix(info.engine);
  probes_ = std::make_unique<ProbeScheduler>(engine_.get(), controller_.get(), metrics_.get(),
                                             capturer_.get(), probe, opts.handler.tolerance);
  if (opts.probe.at_start) probes_->Run("start");
  probes_->StartPeriodic();
  shadow_ = std::make_unique<ShadowRunner>(opts.shadow_threads, opts.shadow_queue);
  handler_ = std::make_unique<VerifyHandler>(engine_.get(), controller_.get(), metrics_.get(),
                                             shadow_.get(), opts.handler);
  handler_->SetCapturer(capturer_.get());
  Engine* const eng = engine_.get();
  const RegionRegistry::HostPinner pin_host = HostPinner();
  if (opts.regions.max_regions > 0) {
    regions_ = std::make_unique<RegionRegistry>(
        opts.regions,
        [eng](int device, const std::string& handle, uint64_t bytes) {
          return eng->OpenCudaIpc(device, handle, bytes);
        },
        pin_host);
    regions_->SetVmmImporter([eng](int device, const std::vector<int>& fds,
                                   const std::vector<uint64_t>& chunk_bytes, uint64_t offset,
                                   uint64_t bytes) {
      return eng->ImportCudaVmm(device, fds, chunk_bytes, offset, bytes);
    });
    regions_->SetObserver(
        [m = metrics_.get()](int64_t n, uint64_t bytes) { m->SetRegions(n, bytes); });
    regions_->SetDenialObserver(DenialReporter());
    handler_->SetRegions(regions_.get());
  }
  return absl::OkStatus();
}

DenialObserver Daemon::DenialReporter() const {
  return [m = metrics_.get(), c = controller_.get()](const Denial& d) {
    m->TenancyRefusal(d.resource, "not_owner");
    const std::string what = absl::StrCat(d.action, " ", d.what, " of ", d.owner);
    spdlog::warn("refused: {} asked to {}", d.caller->label, what);
    c->AuditDenial(d.caller->label, what);
  };
}

RegionRegistry::HostPinner Daemon::HostPinner() const {
  Engine* const eng = engine_.get();
  return [eng](char* base, uint64_t bytes) { return eng->PinHostMemory(base, bytes); };
}

absl::Status Daemon::StartDataPlane() {
  const DaemonOptions& opts = opts_;
  // Data plane.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  VerifyServiceOptions vopts;
  vopts.max_message_bytes = opts.max_message_bytes;
  vopts.max_inflight_bytes = opts.max_inflight_bytes;
  vopts.inflight_peer_share = opts.inflight_peer_share;
  vopts.regions = regions_.get();
  const bool vmm_socket =
      regions_ != nullptr &&
      absl::c_any_of(opts.listen, [](const std::string& a) { return IsUnixAddress(a); });
  if (vmm_socket) vmm_fds_ = std::make_unique<VmmFdInbox>(VmmFdLimits{});
  vopts.vmm_fds = vmm_fds_.get();
  vopts.pin_host = HostPinner();
  vopts.allow_region_tcp = opts.allow_region_tcp;
  vopts.channels = ChannelLimitsFor(opts);
  vopts.kernel_build = VERIFYD_GIT_COMMIT;
  vopts.mode_changes = &mode_changes_;
  vopts.receive_keep_bytes = opts.pinned_receive_bytes;
  vopts.streams = opts.streams;
  // After a burst past what --keep_freed_mb keeps, freed heap memory goes back to the system.
  vopts.heap_trim.after_bytes = HeapTrimmer::AfterBytesFor(opts.keep_freed_bytes);
  verify_service_ =
      std::make_unique<VerifyServiceImpl>(handler_.get(), metrics_.get(), std::move(vopts));
  verify_service_->channels().SetObserver([m = metrics_.get()](int64_t n) { m->SetChannels(n); });
  verify_service_->channels().SetDenialObserver(DenialReporter());
  verify_service_->receive_buffers().SetObserver(
      [m = metrics_.get()](const ReceiveBuffers::Stats& s) {
        m->SetReceiveBuffers(s.bytes, s.pinned_bytes);
      });
  {
    grpc::ServerBuilder b;
    std::vector<int> ports(opts.listen.size(), 0);
    ConfigureServer(b, "verifyd-data", opts.grpc_max_threads, opts.grpc_max_concurrent_streams);
    for (size_t i = 0; i < opts.listen.size(); ++i) {
      if (IsUnixAddress(opts.listen[i])) continue;  // accepted below
      b.AddListeningPort(opts.listen[i], ListenerCredentials(opts.listen[i], opts.tls), &ports[i]);
    }
    const int max_bytes = static_cast<int>(std::min<int64_t>(opts.max_message_bytes, INT32_MAX));
    b.SetMaxReceiveMessageSize(-1);  // the verify service refuses (and counts) larger ones
    b.SetMaxSendMessageSize(max_bytes);
    b.RegisterService(verify_service_.get());
    data_server_ = b.BuildAndStart();
    for (size_t i = 0; i < opts.listen.size(); ++i) {
      if (!data_server_ || (!IsUnixAddress(opts.listen[i]) && ports[i] == 0)) {
        return absl::UnavailableError(
            absl::StrCat("listen: ", StartFailure(opts.listen, opts.tls)));
      }
      listen_addresses_.push_back(Bound(opts.listen[i], ports[i]));
    }
    // Unix sockets are accepted here so that each call's peer uid comes from the kernel
    // (SO_PEERCRED): a shm region is registered only by its object's owner. The socket has the
    // mode and group of --data_socket_mode and --data_socket_group.
    for (const std::string& a : opts.listen) {
      if (!IsUnixAddress(a)) continue;
      auto acceptor =
          UnixSocketAcceptor::Start("listen", a.substr(5), data_server_.get(), opts.data_socket);
      if (!acceptor.ok()) return acceptor.status();
      data_acceptors_.push_back(std::move(*acceptor));
      // CUDA VMM chunks' descriptors (SCM_RIGHTS) arrive next to it, with its mode and group.
      const std::string fds_path = VmmFdSocket::PathFor(a.substr(5));
      if (vmm_fds_ && !VmmFdSocket::PathFits(fds_path)) {
        spdlog::warn(
            "listen: no descriptor socket next to {}: '{}' is too long for a Unix socket; CUDA "
            "VMM regions (RegisterCudaVmmRegion) cannot be registered through it",
            a, fds_path);
      } else if (vmm_fds_) {
        auto fds = VmmFdSocket::Start("listen", fds_path, opts.data_socket, vmm_fds_.get());
        if (!fds.ok()) return fds.status();
        vmm_fd_sockets_.push_back(std::move(*fds));
      }
    }
    data_server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
    data_server_->GetHealthCheckService()->SetServingStatus("", true);
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartAdmin() {
  const DaemonOptions& opts = opts_;
  const EngineInfo& info = info_;
  const BuildInfo& build = build_;
  // Admin.
  if (!opts.admin_listen.empty()) {
    AdminContext actx;
    actx.controller = controller_.get();
    actx.metrics = metrics_.get();
    actx.engine = info;
    actx.build = build;
    actx.runtime =
        RuntimeFactsOf(opts, listen_addresses_,
                       metrics_server_ ? Bound(opts.metrics_address, metrics_port()) : "");
    actx.capturer = capturer_.get();
    actx.regions = regions_.get();
    actx.channels = &verify_service_->channels();
    actx.probes = probes_.get();
    actx.fleet = fleet_.get();
    actx.counters = [this] { return handler_->counters(); };
    actx.token = IsUnixAddress(opts.admin_listen) ? "" : opts.admin_token;
    admin_service_ = std::make_unique<AdminServiceImpl>(std::move(actx));
    grpc::ServerBuilder b;
    int port = 0;
    ConfigureServer(b, "verifyd-admin", kAdminMaxThreads, kAdminMaxStreams);
    if (!IsUnixAddress(opts.admin_listen)) {  // a unix socket is accepted below
      b.AddListeningPort(opts.admin_listen, ListenerCredentials(opts.admin_listen, opts.tls),
                         &port);
    }
    b.RegisterService(admin_service_.get());
    admin_server_ = b.BuildAndStart();
    if (!admin_server_ || (!IsUnixAddress(opts.admin_listen) && port == 0)) {
      return absl::UnavailableError(
          absl::StrCat("admin_listen: ", StartFailure({opts.admin_listen}, opts.tls)));
    }
    if (IsUnixAddress(opts.admin_listen)) {
      // Accepted here so that each call's peer uid comes from the kernel (SO_PEERCRED).
      auto acceptor = UnixSocketAcceptor::Start("admin_listen", opts.admin_listen.substr(5),
                                                admin_server_.get(), SocketAccess{0600, ""});
      if (!acceptor.ok()) return acceptor.status();
      admin_acceptor_ = std::move(*acceptor);
    }
    admin_address_ = Bound(opts.admin_listen, port);
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartFleet() {
  const bool etcd = !opts_.fleet_etcd.empty();
  if (opts_.fleet_file.empty() && !etcd) return absl::OkStatus();
  if (!opts_.fleet_file.empty() && etcd) {
    return absl::InvalidArgumentError("fleet_file and fleet_etcd: give one source, not both");
  }
  fleet::FollowerOptions fo;
  fo.path = opts_.fleet_file;
  fo.node = opts_.node_name.empty() ? HostName() : opts_.node_name;
  fo.build = build_.commit;
  fleet::EtcdOptions eo;
  if (etcd) {
    eo.endpoints = opts_.fleet_etcd;
    eo.prefix = opts_.fleet_etcd_prefix;
    eo.node = fo.node;
    eo.build = fo.build;
    fo.source = absl::StrCat("etcd ", absl::StrJoin(eo.endpoints, ","),
                             absl::StripSuffix(eo.prefix, "/"), "/desired");
  }
  ModeController* const controller = controller_.get();
  Metrics* const metrics = metrics_.get();
  // The fleet proposes; the controller's gate decides, as for an operator's flip, and audits it
  // (who "fleet", the peer its source: "fleet file PATH", "fleet etcd ENDPOINT PREFIX/desired").
  auto propose = [this, controller](const fleet::NodeTarget& t,
                                    const std::string& reason) -> absl::Status {
    ModeChange c;
    c.mode = t.mode;
    c.canary_fraction = t.canary_fraction;
    c.reason = reason;
    c.who = "fleet";
    c.peer = fleet_etcd_ ? absl::StrCat("fleet ", fleet_etcd_->Describe())
                         : absl::StrCat("fleet file ", opts_.fleet_file);
    return controller->SetMode(c).status();
  };
  fleet_ = std::make_unique<fleet::FleetFollower>(
      fo, propose,
      [metrics](const fleet::FollowerStatus& s, bool acted) { metrics->Fleet(s, acted); });
  spdlog::info("following the fleet's desired state in {} as node '{}'", fleet_->source(), fo.node);
  if (!etcd) return fleet_->Start();
  // What the node's status key reports of its mode and gate.
  auto node_state = [controller] {
    const ControllerSnapshot s = controller->Snapshot();
    fleet::NodeState n;
    n.mode = ModeName(s.state.mode);
    n.canary_fraction = s.state.canary_fraction;
    n.gate_open = s.gate.ready;
    n.gate_reason = s.gate.reason;
    return n;
  };
  fleet_etcd_ = std::make_unique<fleet::EtcdSource>(eo, fleet_.get(), node_state);
  fleet_etcd_->Start();
  return absl::OkStatus();
}

void Daemon::LogStarted() const {
  const DaemonOptions& opts = opts_;
  const EngineInfo& info = info_;
  const BuildInfo& build = build_;
  spdlog::info("verifyd {} ({}) engine {} on {}{}", build.version, build.commit, info.engine,
               info.device,
               info.compute_capability.empty()
                   ? ""
                   : absl::StrCat(", ", info.sm_count, " SMs, sm_", info.compute_capability));
  spdlog::info("data plane on {}", absl::StrJoin(listen_addresses_, ", "));
  if (!admin_address_.empty()) spdlog::info("admin on {}", admin_address_);
  if (opts.tls.enabled()) {
    spdlog::info("TLS on the TCP listeners{}",
                 opts.tls.client_ca.empty() ? "" : ", client certificates required");
  } else if (!IsUnixAddress(opts.admin_listen) && !opts.admin_listen.empty()) {
    spdlog::warn("the admin token travels in clear on {} (--insecure_admin_tcp)", admin_address_);
  }
  if (metrics_server_) {
    spdlog::info("metrics on http://{}/metrics", Bound(opts.metrics_address, metrics_port()));
  }
  // Read now: the start-up probe may have rolled the persisted mode back.
  spdlog::info("mode {}, state in {}, captures {}", ModeName(controller_->Snapshot().state.mode),
               opts.state_dir, opts.capture.dir.empty() ? "off" : opts.capture.dir);
}

int Daemon::metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }

void Daemon::OnFatal(const absl::Status& st) {
  {
    absl::MutexLock l(&mu_);
    if (exit_code_ != 0) return;
    exit_code_ = 3;
    stopping_ = true;
  }
  ready_ = false;
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
  ready_ = false;
  absl::MutexLock l(&mu_);
  stopping_ = true;
}

Daemon::~Daemon() {
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
  data_acceptors_.clear();  // hand no more connections to the servers
  vmm_fd_sockets_.clear();
  admin_acceptor_.reset();
  if (data_server_) data_server_->Shutdown(deadline);
  if (admin_server_) admin_server_->Shutdown(deadline);
  if (shadow_) {
    // Comparisons not yet started are dropped: a full queue would hold the exit for seconds
    // (64 reference runs on the CPU engine). The running ones finish while the engine exists.
    if (const int64_t dropped = shadow_->DropQueued(); dropped > 0) {
      spdlog::info("shutdown: {} queued comparisons dropped unrun", dropped);
    }
    shadow_.reset();
  }
  if (controller_) {
    if (absl::Status st = controller_->Flush(); !st.ok()) {
      spdlog::error("gate evidence not saved at shutdown: {}", st.ToString());
    }
  }
}

}  // namespace verifyd
