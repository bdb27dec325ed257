#include "src/server/proto_convert.h"

#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace verifyd {

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

v1::PathKind PathToProto(Path p) {
  switch (p) {
    case Path::kReference:
      return v1::PATH_REFERENCE;
    case Path::kCustom:
      return v1::PATH_CUSTOM;
    case Path::kOracle:
      return v1::PATH_ORACLE;
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

void ToProto(const RegionSummary& s, v1::RegionInfo* out) {
  out->set_name(s.name);
  out->set_kind(s.kind == RegionKind::kShm ? v1::REGION_KIND_SHM : v1::REGION_KIND_CUDA_IPC);
  out->set_shm_key(s.shm_key);
  out->set_shm_offset(s.shm_offset);
  out->set_device(s.device);
  out->set_byte_size(s.byte_size);
  out->set_client(s.client);
  out->set_in_use(s.in_use);
  out->set_calls(s.calls);
  out->set_lost(s.lost);
  out->set_owner(s.owner);
}

void ToProto(const RegionSetSummary& s, v1::RegionSetInfo* out) {
  out->set_name(s.name);
  out->set_kind(s.kind == RegionKind::kShm ? v1::REGION_KIND_SHM : v1::REGION_KIND_CUDA_IPC);
  out->set_members(s.members);
  out->set_byte_size(s.byte_size);
  out->set_client(s.client);
  out->set_owner(s.owner);
  out->set_in_use(s.in_use);
  out->set_calls(s.calls);
  for (uint32_t i : s.lost) out->add_lost(i);
  if (s.kind == RegionKind::kCudaIpc) {
    out->set_device(s.device);
    out->set_vmm_members(s.vmm_members);
  }
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
  out->set_started(
      absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromChrono(f.started), absl::UTCTimeZone()));
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

}  // namespace verifyd
