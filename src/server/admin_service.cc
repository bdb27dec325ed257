#include "src/server/admin_service.h"

#include <openssl/sha.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/server/proto_convert.h"
#include "src/server/region_rpcs.h"
#include "src/server/verify_service.h"
#include "src/transport/unix_socket_acceptor.h"

namespace verifyd {
namespace {

// Constant-time equality, so the token cannot be guessed byte by byte from timings.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string TokenIdentity(const std::string& token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return "token:" +
         absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), 4));
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
  e->set_cpu_fallback(ctx_.build.cpu_fallback);
  if (ctx_.counters) *resp->mutable_counters() = ctx_.counters();
  resp->mutable_counters()->set_rollbacks(s.rollbacks);
  resp->set_last_rollback_reason(s.last_rollback_reason);
  resp->set_comparisons_since_mode_change(s.compared_since_mode_change);
  resp->set_mode_since(s.mode_since);
  if (ctx_.fleet != nullptr) {
    const fleet::FollowerStatus f = ctx_.fleet->status();
    v1::FleetStatus* out = resp->mutable_fleet();
    out->set_file(ctx_.fleet->source());
    out->set_node(ctx_.fleet->options().node);
    out->set_source_up(f.source_up);
    out->set_source_error(f.source_error);
    out->set_generation_seen(f.generation_seen);
    out->set_generation_acted(f.generation_acted);
    out->set_in_step(f.in_step);
    out->set_last_outcome(f.last_outcome);
    out->set_last_detail(f.last_detail);
  }
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
    for (const RegionSetSummary& r : ctx_.regions->ListSets()) {
      ToProto(r, resp->add_region_sets());
    }
    resp->set_region_count(ctx_.regions->count());
    resp->set_max_regions(ctx_.regions->limits().max_regions);
    resp->set_max_regions_per_client(ctx_.regions->limits().max_regions_per_client);
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
      out->set_descriptors(c.descriptors);
      out->set_failed_calls(c.failed_calls);
      if (c.tap) {
        v1::TapInfo* t = out->mutable_tap();
        t->set_backend(c.tap->backend);
        t->set_kv_dtype(c.tap->kv_dtype);
        t->set_calls(c.tap->calls);
        t->set_taps(c.tap->taps);
        t->set_dropped(c.tap->dropped);
        t->set_compared(c.tap->compared);
        t->set_refused(c.tap->refused);
        t->set_worst_custom_vs_reference(c.tap->worst_custom_vs_reference);
        t->set_worst_stack_vs_reference(c.tap->worst_stack_vs_reference);
        t->set_worst_custom_vs_stack(c.tap->worst_custom_vs_stack);
        t->set_stack_breaches(c.tap->stack_breaches);
      }
      if (c.serving_switch) {
        const SwitchState& w = *c.serving_switch;
        v1::SwitchInfo* t = out->mutable_serving_switch();
        t->set_model(w.model);
        t->set_layers(w.layers);
        t->set_path(channel::SwitchPathName(w.directive.path));
        t->set_canary_fraction(w.directive.canary_fraction);
        t->set_lease_ms(w.lease_ms);
        t->set_steps(static_cast<int64_t>(w.counts.steps));
        t->set_op_steps(static_cast<int64_t>(w.counts.op_steps));
        t->set_lease_expired(static_cast<int64_t>(w.counts.lease_expired));
        const bool stepped = w.counts.steps > 0;
        t->set_lease_age_ms(stepped && w.counts.last_step_ns >= w.counts.seen_at_ns
                                ? (w.counts.last_step_ns - w.counts.seen_at_ns) / 1e6
                                : -1);
        t->set_since_last_step_ms(
            stepped ? absl::ToDoubleMilliseconds(absl::Now() - w.last_step_seen) : -1);
      }
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
  if (req->reason().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "reason: a reason is required");
  }
  SampleRateChange c;
  c.mode = *mode;
  c.rate = req->rate();
  c.reason = req->reason();
  c.force = req->force();
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
