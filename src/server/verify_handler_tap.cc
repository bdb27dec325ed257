// The shadow tap's three-way comparison (VerifyHandler::ServeTap): the serving stack's own
// attention output against verifyd's reference and custom paths on the same call.

#include <chrono>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/bundle/request_codec.h"
#include "src/common/seconds_since.h"
#include "src/server/verify_handler.h"

namespace verifyd {
namespace {

TapResult Refused(const absl::Status& st) {
  TapResult r;
  r.error = st.ToString();
  return r;
}

}  // namespace

absl::Status VerifyHandler::WriteRegion(const Peer& owner, RegionKind kind,
                                        const std::string& region, uint64_t offset, const void* src,
                                        uint64_t bytes) {
  if (regions_ == nullptr) return absl::FailedPreconditionError("tap.region: no regions served");
  std::vector<RegionPin> pins;
  absl::StatusOr<RegionRange> r =
      regions_->Resolve("tap.region", kind, region, offset, bytes, &pins, owner);
  if (!r.ok()) return r.status();
  return engine_->WriteRange(*r, src);
}

bool VerifyHandler::TapOracle(PreparedBundle& b, const std::vector<uint16_t>& stack,
                              const std::string& backend, const Tolerance& tol) {
  PathOutput oracle, ref, cus;
  if (!engine_->Run(Path::kOracle, b).ok() || !engine_->Fetch(Path::kOracle, b, &oracle).ok() ||
      !engine_->Fetch(Path::kReference, b, &ref).ok() ||
      !engine_->Fetch(Path::kCustom, b, &cus).ok()) {
    metrics_->OracleError();
    return false;
  }
  const int64_t n = static_cast<int64_t>(oracle.o_f32.size());
  const DiffStats c =
      CompareBf16ToF32(cus.o.data(), oracle.o_f32.data(), n, nullptr, nullptr, 0, tol);
  const DiffStats r =
      CompareBf16ToF32(ref.o.data(), oracle.o_f32.data(), n, nullptr, nullptr, 0, tol);
  const DiffStats s =
      CompareBf16ToF32(stack.data(), oracle.o_f32.data(), n, nullptr, nullptr, 0, tol);
  metrics_->Diff("custom_vs_oracle", c);
  metrics_->Diff("reference_vs_oracle", r);
  metrics_->TapDiff(backend, Metrics::TapPair::kStackVsOracle, s, !Judge(s, tol).match);
  controller_->RecordOracle(c.rel_l2, r.rel_l2);
  return true;
}

TapResult VerifyHandler::ServeTap(const v1::VerifyRequest& call, const std::string& backend,
                                  const Peer& owner) {
  DecodedRequest decoded;
  absl::Status st = DecodeRequest(call, regions_, owner, &decoded);
  if (st.ok()) st = RegionsIntact(decoded.pins);
  if (st.ok()) st = CheckWork(decoded.view);
  if (st.ok() && !decoded.o_out) st = absl::InvalidArgumentError("o_out: the stack's output");
  if (!st.ok()) return Refused(st);
  absl::StatusOr<std::shared_ptr<PreparedBundle>> prepared =
      engine_->PrepareOn(call.device(), decoded.view, /*detach=*/false);
  if (!prepared.ok()) return Refused(prepared.status());
  PreparedBundle& b = **prepared;
  const Plan plan{controller_->mode(), Path::kReference, true};
  const Tolerance tol = tolerance();
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status rs = engine_->Run(Path::kReference, b); !rs.ok()) return Refused(rs);
  metrics_->PathDuration(Path::kReference, Since(t0));
  std::vector<uint16_t> stack(static_cast<size_t>(decoded.view.o_elems()));
  PathOutput ref, cus;
  st = engine_->ReadRange(*decoded.o_out, stack.data());
  if (st.ok()) st = RegionsIntact(decoded.pins);
  if (st.ok()) st = engine_->Fetch(Path::kReference, b, &ref);
  if (!st.ok()) return Refused(st);

  Outcome o;
  o.mode = plan.mode;
  const auto t1 = std::chrono::steady_clock::now();
  absl::Status cs = engine_->Run(Path::kCustom, b);
  if (cs.ok()) {
    metrics_->PathDuration(Path::kCustom, Since(t1));
    cs = engine_->Fetch(Path::kCustom, b, &cus);
  }
  TapResult r;
  r.compared = true;
  const int64_t n = static_cast<int64_t>(stack.size());
  const DiffStats sr = CompareBf16(stack.data(), ref.o.data(), n, nullptr, nullptr, 0, tol);
  const Verdict sv = Judge(sr, tol);
  r.stack_vs_reference = sr.rel_l2;
  r.stack_breach = !sv.match;
  metrics_->TapDiff(backend, Metrics::TapPair::kStackVsReference, sr, !sv.match);
  bool custom_vs_stack_breach = false;
  if (!cs.ok()) {
    o.kind = OutcomeKind::kError;
    o.reason = absl::StrCat("custom path: ", cs.ToString());
  } else {
    absl::StatusOr<DiffStats> cr = engine_->Compare(b, Path::kCustom, Path::kReference, tol);
    if (!cr.ok()) {
      o.kind = OutcomeKind::kError;
      o.reason = absl::StrCat("compare: ", cr.status().ToString());
    } else {
      o.stats = *cr;
      const Verdict v = Judge(*cr, tol);
      o.kind = v.match ? OutcomeKind::kMatch : OutcomeKind::kBreach;
      o.reason = v.reason;
      r.custom_vs_reference = cr->rel_l2;
      metrics_->Diff("custom_vs_reference", *cr);
      metrics_->TapDiff(backend, Metrics::TapPair::kCustomVsReference, *cr, !v.match);
      const DiffStats c2s = CompareBf16(cus.o.data(), stack.data(), n, nullptr, nullptr, 0, tol);
      custom_vs_stack_breach = !Judge(c2s, tol).match;
      r.custom_vs_stack = c2s.rel_l2;
      metrics_->TapDiff(backend, Metrics::TapPair::kCustomVsStack, c2s, custom_vs_stack_breach);
      // The reference against the stack's output, on the same footing as custom's.
      const DiffStats r2s = CompareBf16(ref.o.data(), stack.data(), n, nullptr, nullptr, 0, tol);
      controller_->RecordTap(c2s.rel_l2, r2s.rel_l2);
    }
  }
  if (!sv.match) {
    spdlog::warn("tap ({}): the stack's output breached against the reference on {}: {}", backend,
                 call.request_id(), sv.reason);
  }
  Record(o);
  metrics_->TapEvents(backend, "compared", 1);
  const bool has_oracle = o.stats && DrawOracle() && TapOracle(b, stack, backend, tol);
  if (capturer_) {
    const StackOutput so{&stack, backend};
    Capture(b, plan, o, tol, has_oracle, call.request_id(),
            o.kind != OutcomeKind::kMatch || r.stack_breach || custom_vs_stack_breach, &so);
  }
  return r;
}

}  // namespace verifyd
