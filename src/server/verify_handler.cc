#include "src/server/verify_handler.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/bundle/request_codec.h"
#include "src/common/status_macros.h"
#include "src/server/mode_proto.h"

namespace verifyd {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

v1::PathKind ToProto(Path p) {
  switch (p) {
    case Path::kReference: return v1::PATH_REFERENCE;
    case Path::kCustom: return v1::PATH_CUSTOM;
    case Path::kOracle: return v1::PATH_ORACLE;
  }
  return v1::PATH_UNSPECIFIED;
}


void FillComparison(const DiffStats& d, const Verdict& v, v1::Comparison* c) {
  c->set_test(v1::PATH_CUSTOM);
  c->set_ref(v1::PATH_REFERENCE);
  c->set_count(d.count);
  c->set_rel_l2(d.rel_l2);
  c->set_max_abs(d.max_abs);
  c->set_nmse(d.nmse);
  c->set_beyond_tol(d.beyond_tol);
  c->set_nan_test(d.nan_test);
  c->set_inf_test(d.inf_test);
  c->set_nan_ref(d.nan_ref);
  c->set_inf_ref(d.inf_ref);
  c->set_lse_max_abs(d.lse_max_abs);
  c->set_match(v.match);
  c->set_reason(v.reason);
}

// DataLoss is how engines report a fault that poisons the device context.
bool IsFatal(const absl::Status& st) { return st.code() == absl::StatusCode::kDataLoss; }

}  // namespace

VerifyHandler::VerifyHandler(Engine* engine, ModeController* controller, Metrics* metrics,
                             ShadowRunner* shadow, HandlerOptions opts, FatalHandler on_fatal)
    : engine_(engine),
      controller_(controller),
      metrics_(metrics),
      shadow_(shadow),
      opts_(opts),
      on_fatal_(std::move(on_fatal)),
      tolerance_(opts.tolerance),
      rng_(opts.seed) {}

void VerifyHandler::SetTolerance(const Tolerance& t) {
  absl::MutexLock l(&mu_);
  tolerance_ = t;
}

Tolerance VerifyHandler::tolerance() const {
  absl::MutexLock l(&mu_);
  return tolerance_;
}

bool VerifyHandler::DrawOracle() {
  absl::MutexLock l(&mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < opts_.oracle_sample_rate;
}

void VerifyHandler::Fatal(const absl::Status& st) {
  spdlog::critical("fatal engine error: {}", st.ToString());
  if (on_fatal_) on_fatal_(st);
}

v1::Counters VerifyHandler::counters() const {
  v1::Counters c;
  c.set_requests(requests_.load());
  c.set_request_errors(request_errors_.load());
  c.set_served_reference(served_reference_.load());
  c.set_served_custom(served_custom_.load());
  c.set_comparisons_match(match_.load());
  c.set_comparisons_breach(breach_.load());
  c.set_comparisons_error(error_.load());
  c.set_comparisons_skipped(skipped_.load());
  return c;
}

void VerifyHandler::Record(const Outcome& o) {
  metrics_->Comparison(o.kind);
  switch (o.kind) {
    case OutcomeKind::kMatch: ++match_; break;
    case OutcomeKind::kBreach: ++breach_; break;
    case OutcomeKind::kError:
    case OutcomeKind::kTimeout: ++error_; break;
    case OutcomeKind::kSkipped: ++skipped_; return;  // feeds neither the gate nor a rollback
  }
  if (o.kind != OutcomeKind::kMatch) {
    spdlog::warn("comparison {} in {} mode: {}", OutcomeName(o.kind), ModeName(o.mode), o.reason);
  }
  controller_->Record(o);  // a rollback is logged, audited and counted by the controller
  const ControllerSnapshot snap = controller_->Snapshot();
  metrics_->SetGate(snap.gate);
  metrics_->SetMode(snap.state.mode, snap.state.canary_fraction);
}

absl::Status VerifyHandler::Handle(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                                   const CallContext& call, const InPlaceTensors* in_place) {
  ++requests_;
  absl::Status st = Serve(req, resp, call, in_place);
  if (!st.ok()) ++request_errors_;
  return st;
}

absl::Status VerifyHandler::CheckWork(const BundleView& v) const {
  if (opts_.max_call_work <= 0) return absl::OkStatus();
  // total_kv_len <= 256 * 128K and draft * heads <= 1024 * 128: the product fits in int64.
  const int64_t work = v.total_kv_len * v.shape.draft * v.shape.heads;
  if (work <= opts_.max_call_work) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "request: ", work, " query rows x KV tokens (draft ", v.shape.draft, " x heads ",
      v.shape.heads, " x ", v.total_kv_len, " KV tokens) exceeds --max_call_work=",
      opts_.max_call_work));
}

absl::Status VerifyHandler::Serve(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                                  const CallContext& call, const InPlaceTensors* in_place) {
  const auto t0 = Clock::now();
  // Holds the regions the call names until it returns; work that outlives the call has its own
  // copy of the inputs (Prepare with detach).
  DecodedRequest decoded;
  absl::Status bad = DecodeRequest(req, regions_, &decoded, in_place);
  if (absl::Status lost = RegionsIntact(decoded.pins); !lost.ok()) bad = lost;  // read as zeros
  const BundleView* view = &decoded.view;
  if (bad.ok()) bad = CheckWork(*view);
  if (bad.ok()) bad = call.Check();
  if (!bad.ok()) {
    metrics_->Request("none", bad.code(), Since(t0));
    return bad;
  }
  const double decode_s = Since(t0);
  Plan plan = controller_->Decide(req.request_id());
  std::optional<ShadowRunner::Slot> slot = plan.run_other && !req.compare_sync()
                                               ? ReserveComparison(&plan)
                                               : std::optional<ShadowRunner::Slot>();
  const bool sync = plan.run_other && req.compare_sync();
  const bool async = plan.run_other && !sync;

  auto t1 = Clock::now();
  absl::StatusOr<std::shared_ptr<PreparedBundle>> prepared = engine_->PrepareOn(req.device(), *view, async);
  if (!prepared.ok()) {
    metrics_->Request("none", prepared.status().code(), Since(t0));
    return prepared.status();
  }
  PreparedBundle& b = **prepared;
  const double prepare_s = Since(t1);

  Path served = plan.served;
  t1 = Clock::now();
  absl::Status st = RunServed(plan, b, call, &served);
  if (!st.ok()) {
    if (IsFatal(st)) Fatal(st);
    metrics_->Request(PathName(served), st.code(), Since(t0));
    return st;
  }
  const double served_s = Since(t1);
  metrics_->PathDuration(served, served_s);

  t1 = Clock::now();
  PathOutput out;
  if (st = call.Check(); st.ok()) {
    st = decoded.o_out ? engine_->Deliver(served, b, *decoded.o_out,
                                          decoded.lse_out ? &*decoded.lse_out : nullptr)
                       : engine_->Fetch(served, b, &out);
  }
  // A region whose memory went while the call read it gave zeros, not the client's bytes.
  if (st.ok()) st = RegionsIntact(decoded.pins);
  if (!st.ok()) {
    if (IsFatal(st)) Fatal(st);
    metrics_->Request(PathName(served), st.code(), Since(t0));
    return st;
  }
  const double fetch_s = Since(t1);
  // Fetch reports the path's own time with its output; Deliver does not.
  const absl::StatusOr<double> served_device_s =
      decoded.o_out ? engine_->PathSeconds(served, b) : absl::StatusOr<double>(out.seconds);
  const auto& s = view->shape;
  if (!decoded.o_out) {
    EncodeBf16({view->rows(), s.heads, kernels::kHeadDimV}, out.o.data(), resp->mutable_o());
    if (req.want_lse()) EncodeF32({view->rows(), s.heads}, out.lse.data(), resp->mutable_lse());
  }
  resp->set_request_id(req.request_id());
  resp->set_served_path(ToProto(served));
  resp->set_mode(ModeToProto(plan.mode));

  // The other path, when this call is sampled for a comparison. A served custom path slower
  // than --custom_timeout_ms is a timeout outcome: carried by the call's comparison when there is
  // one, recorded on its own otherwise. The call still serves the custom output it already has.
  const bool fell_back = served != plan.served;
  const double served_custom_s = served == Path::kCustom ? served_s : 0;
  bool compared = false;
  if (plan.run_other && !fell_back) {
    if (sync) {
      compared = true;
      Outcome o = CompareAndRecord(b, plan, req.request_id(), served_custom_s);
      if (o.stats) {
        Verdict v{o.kind == OutcomeKind::kMatch, o.reason};
        FillComparison(*o.stats, v, resp->mutable_comparison());
      }
    } else {
      const auto t2 = Clock::now();
      std::shared_ptr<PreparedBundle> keep = *prepared;
      shadow_->Submit(std::move(*slot), [this, keep, plan, id = req.request_id(), served_custom_s] {
        metrics_->SetShadowQueueDepth(shadow_->depth());
        CompareAndRecord(*keep, plan, id, served_custom_s);
      });
      compared = true;
      metrics_->SetShadowQueueDepth(shadow_->depth());
      metrics_->ShadowOverhead(prepare_s + Since(t2));
    }
  }
  if (!compared && TooSlow(served_custom_s)) {
    Record({OutcomeKind::kTimeout, plan.mode, TimeoutReason(served_custom_s), std::nullopt});
  }

  auto* timing = resp->mutable_timing();
  timing->set_decode_seconds(decode_s);
  timing->set_prepare_seconds(prepare_s);
  timing->set_served_seconds(served_s);
  timing->set_fetch_seconds(fetch_s);
  if (served_device_s.ok()) timing->set_served_device_seconds(*served_device_s);
  timing->set_total_seconds(Since(t0));
  ++(served == Path::kCustom ? served_custom_ : served_reference_);
  metrics_->Request(PathName(served), absl::StatusCode::kOk, Since(t0));
  return absl::OkStatus();
}

std::optional<ShadowRunner::Slot> VerifyHandler::ReserveComparison(Plan* plan) {
  std::optional<ShadowRunner::Slot> slot = shadow_->TryReserve();
  if (slot) {
    metrics_->SetShadowQueueDepth(shadow_->depth());
    return slot;
  }
  if (plan->mode == Mode::kCanary && plan->served == Path::kCustom) {
    metrics_->CanaryShed();
    plan->served = Path::kReference;
  } else {
    Record({OutcomeKind::kSkipped, plan->mode, "shadow queue full", std::nullopt});
  }
  plan->run_other = false;
  return std::nullopt;
}

absl::Status VerifyHandler::RunServed(const Plan& plan, PreparedBundle& b,
                                      const CallContext& call, Path* served) {
  *served = plan.served;
  absl::Status st = engine_->RunForCall(*served, b, call);
  // An abandoned call stops here: not the custom path's fault, nothing to serve.
  if (*served != Path::kCustom || call.Abandoned()) return st;
  if (st.ok()) {
    const auto t = Clock::now();
    absl::StatusOr<bool> finite = engine_->AllFinite(Path::kCustom, b);
    metrics_->FiniteCheck(Since(t));
    if (finite.ok() && *finite) return absl::OkStatus();
    if (finite.ok()) {
      spdlog::warn("custom output has non-finite values; serving the reference");
      *served = Path::kReference;
      VERIFYD_RETURN_IF_ERROR(engine_->RunForCall(Path::kReference, b, call));
      Record(NonFiniteOutcome(b, plan));
      return absl::OkStatus();
    }
    st = finite.status();
  }
  if (IsFatal(st)) Fatal(st);
  spdlog::warn("custom path failed while serving; serving the reference: {}", st.ToString());
  Record({OutcomeKind::kError, plan.mode, absl::StrCat("custom path: ", st.ToString()),
          std::nullopt});
  *served = Path::kReference;
  return engine_->RunForCall(Path::kReference, b, call);
}

Outcome VerifyHandler::NonFiniteOutcome(PreparedBundle& b, const Plan& plan) {
  Outcome o;
  o.kind = OutcomeKind::kBreach;
  o.mode = plan.mode;
  o.reason = "served custom output is not finite";
  const Tolerance tol = tolerance();
  absl::StatusOr<DiffStats> d = engine_->Compare(b, Path::kCustom, Path::kReference, tol);
  if (d.ok()) {
    o.stats = *d;
    metrics_->Diff("custom_vs_reference", *d);
    absl::StrAppend(&o.reason, "; ", Judge(*d, tol).reason);
  } else {
    absl::StrAppend(&o.reason, "; compare: ", d.status().ToString());
  }
  return o;
}

bool VerifyHandler::TooSlow(double custom_s) const {
  return opts_.custom_timeout_seconds > 0 && custom_s > opts_.custom_timeout_seconds;
}

std::string VerifyHandler::TimeoutReason(double custom_s) const {
  return absl::StrCat("custom path took ", custom_s, " s > --custom_timeout_ms ",
                      opts_.custom_timeout_seconds * 1e3, " ms");
}

Outcome VerifyHandler::CompareAndRecord(PreparedBundle& b, const Plan& plan,
                                        const std::string& request_id, double served_custom_s) {
  const Path other = plan.served == Path::kCustom ? Path::kReference : Path::kCustom;
  const Tolerance tol = tolerance();
  Outcome o;
  o.mode = plan.mode;
  const auto t = Clock::now();
  absl::Status st = engine_->Run(other, b);
  const double other_s = Since(t);
  if (!st.ok()) {
    if (IsFatal(st)) Fatal(st);
    o.kind = OutcomeKind::kError;
    o.reason = absl::StrCat(PathName(other), " path: ", st.ToString());
  } else {
    metrics_->PathDuration(other, other_s);
    absl::StatusOr<DiffStats> d = engine_->Compare(b, Path::kCustom, Path::kReference, tol);
    if (!d.ok()) {
      o.kind = OutcomeKind::kError;
      o.reason = absl::StrCat("compare: ", d.status().ToString());
    } else {
      o.stats = *d;
      metrics_->Diff("custom_vs_reference", *d);
      Verdict v = Judge(*d, tol);
      o.kind = v.match ? OutcomeKind::kMatch : OutcomeKind::kBreach;
      o.reason = v.reason;
      const double custom_s = other == Path::kCustom ? other_s : served_custom_s;
      if (v.match && TooSlow(custom_s)) {
        o.kind = OutcomeKind::kTimeout;
        o.reason = TimeoutReason(custom_s);
      }
    }
  }
  bool has_oracle = false;
  if (o.stats && DrawOracle()) {
    if (absl::Status os = engine_->Run(Path::kOracle, b); os.ok()) {
      auto c = engine_->Compare(b, Path::kCustom, Path::kOracle, tol);
      auto r = engine_->Compare(b, Path::kReference, Path::kOracle, tol);
      if (c.ok() && r.ok()) {
        has_oracle = true;
        metrics_->Diff("custom_vs_oracle", *c);
        metrics_->Diff("reference_vs_oracle", *r);
        controller_->RecordOracle(c->rel_l2, r->rel_l2);
      } else {
        metrics_->OracleError();
      }
    } else {
      metrics_->OracleError();
    }
  }
  Record(o);
  if (capturer_) Capture(b, plan, o, tol, has_oracle, request_id);
  return o;
}

}  // namespace verifyd

namespace verifyd {

void VerifyHandler::Capture(PreparedBundle& b, const Plan& plan, const Outcome& o,
                            const Tolerance& tol, bool has_oracle, const std::string& request_id) {
  const std::string trigger = capturer_->Claim(o.kind != OutcomeKind::kMatch);
  if (trigger.empty()) return;
  ComparisonRecord rec;
  absl::StatusOr<std::shared_ptr<const OwnedBundle>> inputs = engine_->FetchInputs(b);
  if (!inputs.ok()) {
    spdlog::warn("capture skipped: {}", inputs.status().ToString());
    return;
  }
  rec.bundle = *inputs;
  rec.plan = plan;
  rec.outcome = o;
  rec.tolerance = tol;
  rec.request_id = request_id;
  engine_->Fetch(Path::kReference, b, &rec.reference).IgnoreError();
  engine_->Fetch(Path::kCustom, b, &rec.custom).IgnoreError();
  if (has_oracle) rec.has_oracle = engine_->Fetch(Path::kOracle, b, &rec.oracle).ok();
  absl::StatusOr<std::string> path = capturer_->Write(rec, trigger);
  if (path.ok()) {
    metrics_->Capture(trigger);
    spdlog::info("captured {} ({})", *path, trigger);
  } else {
    spdlog::warn("capture failed: {}", path.status().ToString());
  }
}

}  // namespace verifyd
