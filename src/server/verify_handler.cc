#include "src/server/verify_handler.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/bundle/request_codec.h"
#include "src/common/seconds_since.h"
#include "src/common/status_macros.h"
#include "src/server/proto_convert.h"

namespace verifyd {
namespace {

// A call as Metrics::Request counts it, reported once when the call returns: the path that served
// it ("none" before one ran), its status and its time.
class CallRecord {
 public:
  CallRecord(Metrics* metrics, std::chrono::steady_clock::time_point t0)
      : metrics_(metrics), t0_(t0) {}
  CallRecord(const CallRecord&) = delete;
  CallRecord& operator=(const CallRecord&) = delete;
  ~CallRecord() { metrics_->Request(path_, code_, Since(t0_)); }

  void Served(Path p) { path_ = PathName(p); }
  absl::Status Done(absl::Status st) {
    code_ = st.code();
    return st;
  }

 private:
  Metrics* const metrics_;
  const std::chrono::steady_clock::time_point t0_;
  const char* path_ = "none";
  absl::StatusCode code_ = absl::StatusCode::kUnknown;
};

using Clock = std::chrono::steady_clock;

}  // namespace

VerifyHandler::VerifyHandler(Engine* engine, ModeController* controller, Metrics* metrics,
                             ShadowRunner* shadow, HandlerOptions opts)
    : engine_(engine),
      controller_(controller),
      metrics_(metrics),
      shadow_(shadow),
      opts_(opts),
      rng_(opts.seed) {}

Tolerance VerifyHandler::tolerance() const { return opts_.tolerance; }

bool VerifyHandler::DrawOracle() {
  absl::MutexLock l(&mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < opts_.oracle_sample_rate;
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
    case OutcomeKind::kMatch:
      ++match_;
      break;
    case OutcomeKind::kBreach:
      ++breach_;
      break;
    case OutcomeKind::kError:
    case OutcomeKind::kTimeout:
      ++error_;
      break;
    case OutcomeKind::kSkipped:
      ++skipped_;
      return;  // feeds neither the gate nor a rollback
  }
  if (o.kind != OutcomeKind::kMatch) {
    spdlog::warn("comparison {} in {} mode: {}", OutcomeName(o.kind), ModeName(o.mode), o.reason);
  }
  // A rollback is logged, audited and counted by the controller, and the gauges follow it.
  controller_->Record(o);
}

void VerifyHandler::ZeroOutputs(const v1::VerifyRequest& req, const Peer& caller) {
  if (regions_ == nullptr) return;
  for (const auto& [field, t] : {std::pair<const char*, const v1::Tensor*>{"o_out", &req.o_out()},
                                 {"lse_out", &req.lse_out()}}) {
    RegionName which;
    uint64_t offset = 0, bytes = 0;
    RegionKind kind = RegionKind::kShm;
    if (t->has_shm()) {
      which = RegionName{t->shm().region(), t->shm().set(), t->shm().index()};
      offset = t->shm().offset();
      bytes = t->shm().byte_size();
    } else if (t->has_cuda_ipc()) {
      kind = RegionKind::kCudaIpc;
      which = RegionName{t->cuda_ipc().region(), t->cuda_ipc().set(), t->cuda_ipc().index()};
      offset = t->cuda_ipc().offset();
      bytes = t->cuda_ipc().byte_size();
    } else {
      continue;
    }
    std::vector<RegionPin> pins;
    absl::StatusOr<RegionRange> r =
        regions_->Resolve(field, kind, which, offset, bytes, &pins, caller);
    absl::Status st = r.ok() ? engine_->ZeroFill(*r) : r.status();
    if (!st.ok()) spdlog::warn("zero-filling a failed call's {}: {}", field, st.ToString());
  }
}

absl::Status VerifyHandler::Handle(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                                   const CallContext& call, const InPlaceTensors* in_place,
                                   uint64_t layout_key) {
  ++requests_;
  absl::Status st = Serve(req, resp, call, in_place, layout_key);
  if (!st.ok()) ++request_errors_;
  return st;
}

absl::Status VerifyHandler::CheckWork(const BundleView& v) const {
  if (opts_.max_call_work <= 0) return absl::OkStatus();
  // total_kv_len <= 256 * 128K and draft * heads <= 1024 * 128: the product fits in int64.
  const int64_t work = v.total_kv_len * v.shape.draft * v.shape.heads;
  if (work <= opts_.max_call_work) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("request: ", work, " query rows x KV tokens (draft ", v.shape.draft, " x heads ",
                   v.shape.heads, " x ", v.total_kv_len,
                   " KV tokens) exceeds --max_call_work=", opts_.max_call_work));
}

absl::Status VerifyHandler::Serve(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                                  const CallContext& call, const InPlaceTensors* in_place,
                                  uint64_t layout_key) {
  const auto t0 = Clock::now();
  CallRecord record(metrics_, t0);
  // Holds the regions the call names until it returns; work that outlives the call has its own
  // copy of the inputs (Prepare with detach).
  DecodedRequest decoded;
  absl::Status bad = DecodeRequest(req, regions_, call.peer(), &decoded, in_place);
  if (absl::Status lost = RegionsIntact(decoded.pins); !lost.ok()) bad = lost;  // read as zeros
  decoded.view.layout_key = layout_key;
  const BundleView* view = &decoded.view;
  if (bad.ok()) bad = CheckWork(*view);
  if (bad.ok()) bad = call.Check();
  if (!bad.ok()) {
    return record.Done(bad);
  }
  const double decode_s = Since(t0);
  Plan plan = controller_->Decide(req.request_id());
  std::optional<ShadowRunner::Slot> slot = plan.run_other && !req.compare_sync()
                                               ? ReserveComparison(&plan)
                                               : std::optional<ShadowRunner::Slot>();
  // A copy the engine makes of the inputs (for a comparison that outlives the call, or to read
  // them aligned) holds its bytes of the memory budget for as long as it lives. A comparison
  // whose copy does not fit is shed. The call's own aligned copy is held when it fits, and made
  // regardless: it lives no longer than the call, whose message was admitted.
  absl::StatusOr<std::shared_ptr<void>> held =
      call.HoldBytes(engine_->PreparedHostBytes(*view, plan.run_other && !req.compare_sync()));
  if (!held.ok() && slot) {
    slot.reset();
    ShedComparison(&plan, "memory budget full");
    held = call.HoldBytes(engine_->PreparedHostBytes(*view, false));
  }
  if (!held.ok()) held = std::shared_ptr<void>();
  const bool sync = plan.run_other && req.compare_sync();
  const bool async = plan.run_other && !sync;

  auto t1 = Clock::now();
  absl::StatusOr<std::shared_ptr<PreparedBundle>> prepared =
      engine_->PrepareOn(req.device(), *view, async);
  if (!prepared.ok()) {
    return record.Done(prepared.status());
  }
  PreparedBundle& b = **prepared;
  const double prepare_s = Since(t1);

  Path served = plan.served;
  bool delivered = false;
  t1 = Clock::now();
  absl::Status st = RunServed(plan, b, call, decoded, &served, &delivered);
  record.Served(served);
  if (!st.ok()) return record.Done(st);
  const double served_s = Since(t1);
  metrics_->PathDuration(served, served_s);

  t1 = Clock::now();
  PathOutput out;
  if (st = call.Check(); st.ok() && !delivered) {
    st = decoded.o_out ? engine_->Deliver(served, b, *decoded.o_out, decoded.lse_out_range())
                       : engine_->Fetch(served, b, &out);
  }
  // A region whose memory went while the call read it gave zeros, not the client's bytes.
  if (st.ok()) st = RegionsIntact(decoded.pins);
  if (!st.ok()) {
    return record.Done(st);
  }
  // Page ids and mask checked on the device: the paths read page 0 for a bad page id, so a call
  // that fails here leaves zeros in o_out, not that output.
  if (st = engine_->InputChecks(b); !st.ok()) {
    if (st.code() == absl::StatusCode::kInvalidArgument) ZeroOutputs(req, call.peer());
    return record.Done(st);
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
  resp->set_served_path(PathToProto(served));
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
      shadow_->Submit(std::move(*slot),
                      [this, keep, held = *held, plan, id = req.request_id(), served_custom_s] {
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
  return record.Done(absl::OkStatus());
}

std::optional<ShadowRunner::Slot> VerifyHandler::ReserveComparison(Plan* plan) {
  std::optional<ShadowRunner::Slot> slot = shadow_->TryReserve();
  if (slot) {
    metrics_->SetShadowQueueDepth(shadow_->depth());
    return slot;
  }
  ShedComparison(plan, "shadow queue full");
  return std::nullopt;
}

void VerifyHandler::ShedComparison(Plan* plan, const char* why) {
  if (plan->mode == Mode::kCanary && plan->served == Path::kCustom) {
    metrics_->CanaryShed();
    plan->served = Path::kReference;
  } else {
    Record({OutcomeKind::kSkipped, plan->mode, why, std::nullopt});
  }
  plan->run_other = false;
}

absl::Status VerifyHandler::RunServed(const Plan& plan, PreparedBundle& b, const CallContext& call,
                                      const DecodedRequest& decoded, Path* served,
                                      bool* delivered) {
  *served = plan.served;
  *delivered = false;
  absl::Status st = engine_->RunForCall(*served, b, call);
  // An abandoned call stops here: not the custom path's fault, nothing to serve.
  if (*served != Path::kCustom || call.Abandoned()) return st;
  if (st.ok()) {
    const auto t = Clock::now();
    absl::StatusOr<bool> finite =
        decoded.o_out
            ? engine_->DeliverIfFinite(Path::kCustom, b, *decoded.o_out, decoded.lse_out_range())
            : engine_->AllFinite(Path::kCustom, b);
    metrics_->FiniteCheck(Since(t));
    *delivered = finite.ok() && *finite && decoded.o_out;
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
  spdlog::warn("custom path failed while serving; serving the reference: {}", st.ToString());
  Record(
      {OutcomeKind::kError, plan.mode, absl::StrCat("custom path: ", st.ToString()), std::nullopt});
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
  if (capturer_) {
    Capture(b, plan, o, tol, has_oracle, request_id, o.kind != OutcomeKind::kMatch);
  }
  return o;
}

}  // namespace verifyd

namespace verifyd {

void VerifyHandler::Capture(PreparedBundle& b, const Plan& plan, const Outcome& o,
                            const Tolerance& tol, bool has_oracle, const std::string& request_id,
                            bool breach, const StackOutput* stack) {
  const std::string trigger = capturer_->Claim(breach);
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
  if (stack != nullptr) {
    rec.stack_o = *stack->o;
    rec.stack_backend = stack->backend;
  }
  absl::StatusOr<std::string> path = capturer_->Write(rec, trigger);
  if (path.ok()) {
    metrics_->Capture(trigger);
    spdlog::info("captured {} ({})", *path, trigger);
  } else {
    spdlog::warn("capture failed: {}", path.status().ToString());
  }
}

}  // namespace verifyd
