#include "src/server/admin_service.h"

#include "src/server/region_rpcs.h"

#include <openssl/sha.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/server/mode_proto.h"
#include "src/server/unix_socket_acceptor.h"
#include "src/server/verify_service.h"

namespace verifyd {
namespace {

// Constant-time equality, so the token cannot be guessed byte by byte from timings.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

void FillRuntime(const RuntimeFacts& f, v1::RuntimeConfig* out) {
  out->set_inject_custom_fault(f.inject_custom_fault);
  auto* t = out->mutable_tolerances();
  t->set_atol(f.tolerance.atol);
  t->set_rtol(f.tolerance.rtol);
  t->set_max_rel_l2(f.tolerance.max_rel_l2);
  t->set_max_abs(f.tolerance.max_abs);
  t->set_max_lse_abs(f.tolerance.max_lse_abs);
  t->set_max_beyond_tol(f.tolerance.max_beyond_tol);
  t->set_atol_rel(f.tolerance.atol_rel);
  t->set_max_row_rel_l2(f.tolerance.max_row_rel_l2);
  out->set_gate_window(f.gate_window);
  out->set_rollback_breaches(f.rollback_breaches);
  out->set_rollback_window(f.rollback_window);
  out->set_oracle_sample_rate(f.oracle_sample_rate);
  out->set_custom_timeout_ms(f.custom_timeout_seconds * 1000);
  out->set_uptime_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - f.started_steady).count());
  out->set_started(absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromChrono(f.started),
                                    absl::UTCTimeZone()));
  // Regions (registered shared-memory / CUDA IPC buffers) are listed here once they exist.
  for (const std::string& l : f.listen) out->add_listen(l);
  out->set_admin_listen(f.admin_listen);
  out->set_metrics_address(f.metrics_address);
  out->set_state_dir(f.state_dir);
}

void FillDrift(const DriftStatus& d, v1::DriftStatus* out) {
  out->set_samples(d.reading.samples);
  out->set_ratio(d.reading.ratio);
  out->set_t(d.reading.t);
  out->set_breach(d.reading.breach);
  out->set_breaches(d.breaches);
  out->set_last_breach(d.last_breach);
  out->set_window(d.options.window);
  out->set_min_samples(d.options.min_samples);
  out->set_max_ratio(d.options.max_ratio);
  out->set_min_t(d.options.min_t);
}

void FillProbe(const ProbeScheduler* p, v1::ProbeStatus* out) {
  if (p == nullptr) return;
  const ProbeRunStatus s = p->Status();
  out->set_runs(s.runs);
  out->set_failed_runs(s.failed_runs);
  out->set_has_run(s.has_run);
  out->set_last_passed(s.last_passed);
  out->set_last_time(s.last_time);
  out->set_last_trigger(s.last_trigger);
  out->set_last_summary(s.last_summary);
  out->set_last_seconds(s.last_seconds);
  out->set_at_start(p->options().at_start);
  out->set_interval_seconds(p->options().interval_seconds);
  out->set_max_prefix(p->options().suite.max_prefix);
}

void FillCapture(const Capturer* c, v1::CaptureStatus* out) {
  if (c == nullptr) return;
  const CaptureStatus s = c->Status();
  out->set_dir(s.dir);
  out->set_files(s.files);
  out->set_bytes(s.bytes);
  out->set_pending(s.pending);
  out->set_written(s.written);
  out->set_dropped(s.dropped);
}

}  // namespace

std::string TokenIdentity(const std::string& token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return "token:" + absl::BytesToHexString(
                        absl::string_view(reinterpret_cast<const char*>(digest), 4));
}

AdminServiceImpl::AdminServiceImpl(AdminContext ctx)
    : ctx_(std::move(ctx)), token_identity_(ctx_.token.empty() ? "" : TokenIdentity(ctx_.token)) {}

grpc::Status AdminServiceImpl::Authorize(grpc::ServerContext* ctx) {
  if (ctx_.token.empty()) return grpc::Status::OK;
  const std::string want = "Bearer " + ctx_.token;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    AuthFailed(*ctx, "no bearer token");
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization: missing bearer token (verifyctl --admin_token_file)");
  }
  const std::string got(it->second.data(), it->second.size());
  if (!SameSecret(got, want)) {
    AuthFailed(*ctx, "bad bearer token");
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: bad bearer token");
  }
  return grpc::Status::OK;
}

void AdminServiceImpl::AuthFailed(const grpc::ServerContext& ctx, const std::string& why) {
  ctx_.metrics->AdminAuthFailure();
  const auto now = std::chrono::steady_clock::now();
  int64_t suppressed = 0;
  {
    absl::MutexLock l(&auth_log_mu_);
    if (last_auth_log_ != std::chrono::steady_clock::time_point() &&
        now - last_auth_log_ < ctx_.auth_log_interval) {
      ++auth_log_suppressed_;
      return;
    }
    last_auth_log_ = now;
    suppressed = auth_log_suppressed_;
    auth_log_suppressed_ = 0;
  }
  spdlog::warn("admin authentication failed from {}: {}{}", ctx.peer(), why,
               suppressed == 0
                   ? std::string()
                   : absl::StrCat(" (and ", suppressed, " more since the last such line)"));
}

std::string AdminServiceImpl::Peer(const grpc::ServerContext& ctx) const {
  if (!token_identity_.empty()) return token_identity_;
  if (std::optional<std::string> uid = UnixPeerIdentity(ctx.peer())) return *uid;
  return "unverified:" + ctx.peer();
}

grpc::Status AdminServiceImpl::GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest*,
                                         v1::GetStatusResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  const ControllerSnapshot s = ctx_.controller->Snapshot();
  resp->set_mode(ModeToProto(s.state.mode));
  resp->set_canary_fraction(s.state.canary_fraction);
  resp->set_sample_rate(s.state.mode == Mode::kCustom ? s.state.custom_sample_rate
                                                      : s.state.shadow_sample_rate);
  auto* g = resp->mutable_gate();
  g->set_ready(s.gate.ready);
  g->set_clean(s.gate.clean);
  g->set_needed(s.gate.needed);
  g->set_reason(s.gate.reason);
  g->set_last_breach(s.gate.last_breach);
  auto* r = resp->mutable_recent();
  r->set_comparisons(s.recent.comparisons);
  r->set_breaches(s.recent.breaches);
  r->set_rel_l2_mean(s.recent.rel_l2_mean);
  r->set_rel_l2_max(s.recent.rel_l2_max);
  r->set_max_abs_max(s.recent.max_abs_max);
  r->set_oracle_samples(s.recent.oracle_samples);
  r->set_custom_vs_oracle_rel_l2(s.recent.custom_vs_oracle);
  r->set_reference_vs_oracle_rel_l2(s.recent.reference_vs_oracle);
  FillDrift(s.drift, resp->mutable_drift());
  FillProbe(ctx_.probes, resp->mutable_probe());
  auto* e = resp->mutable_engine();
  e->set_engine(ctx_.engine.engine);
  e->set_device(ctx_.engine.device);
  e->set_sm_count(ctx_.engine.sm_count);
  e->set_compute_capability(ctx_.engine.compute_capability);
  if (ctx_.counters) *resp->mutable_counters() = ctx_.counters();
  resp->mutable_counters()->set_rollbacks(s.rollbacks);
  resp->set_last_rollback_reason(s.last_rollback_reason);
  for (const AuditEntry& a : ctx_.controller->RecentAudit(10)) {
    auto* pa = resp->add_recent_audit();
    pa->set_time(a.time);
    pa->set_from(ModeToProto(a.from));
    pa->set_to(ModeToProto(a.to));
    pa->set_canary_fraction(a.canary_fraction);
    pa->set_reason(a.reason);
    pa->set_forced(a.forced);
    pa->set_who(a.who);
    pa->set_peer(a.peer);
  }
  resp->set_shadow_sample_rate(s.state.shadow_sample_rate);
  resp->set_custom_sample_rate(s.state.custom_sample_rate);
  FillCapture(ctx_.capturer, resp->mutable_capture());
  resp->set_version(ctx_.build.version);
  resp->set_commit(ctx_.build.commit);
  FillRuntime(ctx_.runtime, resp->mutable_runtime());
  if (ctx_.regions != nullptr) {
    for (const RegionSummary& r : ctx_.regions->List()) ToProto(r, resp->add_regions());
  }
  if (ctx_.channels != nullptr) {
    for (const ChannelSummary& c : ctx_.channels->List()) {
      v1::ChannelInfo* out = resp->add_channels();
      out->set_name(c.name);
      out->set_key(c.key);
      out->set_byte_size(c.byte_size);
      out->set_capacity(c.geometry.capacity);
      out->set_client(c.client);
      out->set_calls(c.calls);
      out->set_stopped(c.stopped);
      out->set_client_pid(c.client_pid);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetMode(grpc::ServerContext* ctx, const v1::SetModeRequest* req,
                                       v1::SetModeResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  std::optional<Mode> mode = ModeFromProto(req->mode());
  if (!mode) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("mode: ", v1::Mode_Name(req->mode()), " is not a mode"));
  }
  if (*mode != Mode::kCanary && req->canary_fraction() != 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("canary_fraction: only MODE_CANARY takes a fraction, not ",
                                     v1::Mode_Name(req->mode())));
  }
  ModeChange c;
  c.mode = *mode;
  c.canary_fraction = req->canary_fraction();
  c.reason = req->reason();
  c.force = req->force();
  const std::string peer = Peer(*ctx);
  c.who = req->who().empty() ? peer : req->who();
  c.peer = peer;
  absl::StatusOr<PersistedState> st = ctx_.controller->SetMode(c);
  if (!st.ok()) return ToGrpc(st.status());
  resp->set_mode(ModeToProto(st->mode));
  resp->set_canary_fraction(st->canary_fraction);
  resp->set_forced(req->force());
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetSampling(grpc::ServerContext* ctx,
                                           const v1::SetSamplingRequest* req,
                                           v1::SetSamplingResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  std::optional<Mode> mode = ModeFromProto(req->mode());
  if (!mode) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mode: shadow or custom");
  }
  SampleRateChange c;
  c.mode = *mode;
  c.rate = req->rate();
  c.peer = Peer(*ctx);
  c.who = req->who().empty() ? c.peer : req->who();
  if (absl::Status st = ctx_.controller->SetSampleRate(c); !st.ok()) {
    return ToGrpc(st);
  }
  const PersistedState s = ctx_.controller->Snapshot().state;
  resp->set_shadow_sample_rate(s.shadow_sample_rate);
  resp->set_custom_sample_rate(s.custom_sample_rate);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::Capture(grpc::ServerContext* ctx, const v1::CaptureRequest* req,
                                       v1::CaptureResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (ctx_.capturer == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "capture_dir: capture is off (start verifyd with --capture_dir)");
  }
  if (req->next() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "next: must be >= 0");
  }
  ctx_.capturer->RequestNext(req->next());
  FillCapture(ctx_.capturer, resp->mutable_capture());
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::RunProbes(grpc::ServerContext* ctx, const v1::RunProbesRequest*,
                                         v1::RunProbesResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (ctx_.probes == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "probe: this daemon has no probes");
  }
  const ProbeReport report = ctx_.probes->Run("requested");
  resp->set_passed(report.passed());
  resp->set_seconds(report.seconds);
  resp->set_summary(report.Summary());
  for (const ProbeResult& r : report.results) {
    auto* out = resp->add_results();
    out->set_name(r.name);
    out->set_feature(r.feature);
    out->set_passed(r.passed);
    out->set_reason(r.reason);
    out->set_rel_l2(r.stats.rel_l2);
    out->set_max_row_rel_l2(r.stats.max_row_rel_l2);
    out->set_max_abs(r.stats.max_abs);
    out->set_seconds(r.seconds);
  }
  return grpc::Status::OK;
}

}  // namespace verifyd
