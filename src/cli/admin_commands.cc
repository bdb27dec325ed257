#include "src/cli/admin_commands.h"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <vector>

#include "absl/strings/ascii.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "src/cli/proto_json.h"
#include "src/common/host_name.h"
#include "verifyd/v1/admin.grpc.pb.h"

namespace verifyd::cli {
namespace {

std::string ModeStr(v1::Mode m) {
  std::string s = v1::Mode_Name(m);
  return absl::AsciiStrToLower(s.substr(5));  // MODE_SHADOW -> shadow
}

std::string RegionKindStr(const v1::RegionInfo& r) {
  return r.kind() == v1::REGION_KIND_SHM ? "shm" : "cuda_ipc";
}

std::string Who() {
  const char* user = std::getenv("USER");
  if (user == nullptr) {
    const passwd* pw = getpwuid(getuid());
    user = pw ? pw->pw_name : nullptr;
  }
  return fmt::format("{}@{}", user ? user : "unknown", HostName());
}

std::string Num(double v) { return std::isfinite(v) ? fmt::format("{:.3g}", v) : "-"; }

// "3d 4h", "2h 5m", "4m 10s", "12s".
std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  if (s >= 86400) return fmt::format("{}d {}h", s / 86400, s % 86400 / 3600);
  if (s >= 3600) return fmt::format("{}h {}m", s / 3600, s % 3600 / 60);
  if (s >= 60) return fmt::format("{}m {}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// At most `n` characters of `text` on one line: a reason can quote a whole probe report.
std::string Clip(std::string text, size_t n = 160) {
  for (char& ch : text) {
    if (ch == '\n') ch = ' ';
  }
  if (text.size() > n) text = text.substr(0, n - 3) + "...";
  return text;
}

// "drift       ok: custom/reference error vs oracle 1.08x over 64 samples (t -41 < 3 against
// 1.35x); 0 breaches".
void PrintDrift(const v1::DriftStatus& d) {
  std::string verdict =
      d.samples() == 0 ? "no oracle samples yet"
      : !std::isfinite(d.t())
          ? fmt::format("{}x over {} samples, no verdict before {}", Num(d.ratio()), d.samples(),
                        d.min_samples())
          : fmt::format("{}x over {} samples (t {} {} {} against {}x)", Num(d.ratio()), d.samples(),
                        Num(d.t()), d.breach() ? ">=" : "<", d.min_t(), d.max_ratio());
  std::cout << fmt::format("drift       {}: custom/reference error vs oracle {}; {} breaches{}\n",
                           d.breach() ? "IN BREACH" : "ok", verdict, d.breaches(),
                           d.last_breach().empty() ? "" : ", last " + d.last_breach());
}

// "probe       passed: 23 of 23 probes passed in 0.81 s (start, 2026-...); 1 run, 0 failed;
// every 600 s in canary/custom, prefixes up to 2048".
void PrintProbe(const v1::ProbeStatus& p) {
  const std::string schedule = fmt::format(
      "{}{}, prefixes up to {}", p.at_start() ? "at start-up and " : "",
      p.interval_seconds() > 0 ? fmt::format("every {} s in canary/custom", p.interval_seconds())
                               : std::string("on demand"),
      p.max_prefix());
  if (!p.has_run()) {
    std::cout << fmt::format("probe       not run yet; {}\n", schedule);
    return;
  }
  std::cout << fmt::format("probe       {}: {} ({}, {}); {} runs, {} failed; {}\n",
                           p.last_passed() ? "passed" : "FAILED", Clip(p.last_summary()),
                           p.last_trigger(), p.last_time(), p.runs(), p.failed_runs(), schedule);
}

// What the operator would do next, from the mode and the gate.
std::string NextStep(const v1::GetStatusResponse& s) {
  const auto& gate = s.gate();
  switch (s.mode()) {
    case v1::MODE_REFERENCE:
      return "verifyctl rollback --reason \"...\"   (back to shadow: compare again; the gate "
             "starts over)";
    case v1::MODE_SHADOW: {
      if (gate.ready())
        return "verifyctl flip canary --reason \"...\"   (fraction 0.05 by default)";
      // Each thing the gate waits for, with the command that brings it.
      std::vector<std::string> needs;
      if (const int64_t more = gate.needed() - gate.clean(); more > 0) {
        needs.push_back(
            fmt::format("{} more clean comparisons in a row (traffic, or verifyctl send)", more));
      }
      const auto& probe = s.probe();
      if (probe.has_run() && !probe.last_passed()) {
        needs.push_back(
            "a passing probe run: fix the custom path, then verifyctl probe (exit 0 when it "
            "passes)");
      } else if (probe.at_start() && !probe.has_run()) {
        needs.push_back("a passing probe run (verifyctl probe)");
      }
      if (s.drift().breach()) needs.push_back("the oracle drift test out of breach");
      if (needs.empty()) needs.push_back("the gate to open");
      return fmt::format("the gate needs {}; a flip before that needs --force, which is audited",
                         fmt::join(needs, "; and "));
    }
    case v1::MODE_CANARY:
      return "verifyctl flip custom --reason \"...\" once the canary looks right; verifyctl "
             "rollback --reason \"...\" to go back";
    case v1::MODE_CUSTOM:
      return "watch the comparisons; verifyctl rollback --reason \"...\" to go back, verifyctl "
             "flip reference --reason \"...\" to stop comparing (the kill switch)";
    default:
      return "";
  }
}

// The page an operator reads during a rollout: the mode, what is compared, the gate, the last
// breach once, and the next command.
void PrintRollout(const v1::GetStatusResponse& s) {
  std::string mode = ModeStr(s.mode());
  if (s.mode() == v1::MODE_CANARY) {
    mode += fmt::format(" ({:g}% of calls served by custom)", s.canary_fraction() * 100);
  }
  if (!s.mode_since().empty()) mode += "   since " + s.mode_since();
  std::cout << fmt::format("mode        {}\n", mode);
  std::string comparing;
  switch (s.mode()) {
    case v1::MODE_REFERENCE:
      comparing = "nothing: reference mode serves the reference alone";
      break;
    case v1::MODE_SHADOW:
      comparing = fmt::format("custom against the served reference on {:g}% of calls",
                              s.shadow_sample_rate() * 100);
      break;
    case v1::MODE_CANARY:
      comparing = "custom against the reference on every canary call";
      break;
    default:
      comparing = fmt::format("the reference against the served custom on {:g}% of calls",
                              s.custom_sample_rate() * 100);
  }
  std::cout << fmt::format("comparing   {}; {} comparisons since the mode {}\n", comparing,
                           s.comparisons_since_mode_change(),
                           s.mode_since().empty() ? "was loaded" : "changed");
  if (s.mode() == v1::MODE_CUSTOM && s.custom_sample_rate() == 0) {
    std::cout << "WARNING     custom sample rate 0: nothing is compared while custom is served, "
                 "so no breach is seen and no rollback can fire\n";
  }
  const auto& gate = s.gate();
  std::string causes;
  if (s.drift().breach()) causes += "; oracle drift in breach";
  if (s.probe().has_run() && !s.probe().last_passed()) causes += "; the probe suite failed";
  if (s.probe().at_start() && !s.probe().has_run()) causes += "; the probe suite has not run";
  std::cout << fmt::format("gate        {}: {} of {} clean in a row{}\n",
                           gate.ready() ? "ready" : "NOT ready", gate.clean(), gate.needed(),
                           causes);
  if (!gate.last_breach().empty()) {
    std::cout << fmt::format("last breach {}\n", Clip(gate.last_breach()));
  }
  std::cout << fmt::format("next        {}\n", NextStep(s));
}

// What clients have attached: regions, region sets (one line per set, whatever its members: a
// rank's 61 layer pools are one line) and call channels.
void PrintRegionsAndChannels(const v1::GetStatusResponse& s) {
  if (s.regions().empty() && s.region_sets().empty()) {
    std::cout << "regions     none\n";
  } else {
    std::cout << fmt::format(
        "regions     {} of --max_regions {} (set members included), at most {} "
        "per client\n",
        s.region_count(), s.max_regions(), s.max_regions_per_client());
  }
  for (const auto& r : s.regions()) {
    std::cout << fmt::format(
        "region      {}  {} {:.1f} MB{}  client '{}' ({})  calls {}  in use {}{}\n", r.name(),
        RegionKindStr(r), r.byte_size() / 1e6,
        r.kind() == v1::REGION_KIND_SHM ? fmt::format(" of {} at {}", r.shm_key(), r.shm_offset())
                                        : fmt::format(" on GPU {}", r.device()),
        r.client(), r.owner(), r.calls(), r.in_use(),
        r.lost() ? "  LOST (object shrank; unregister it)" : "");
  }
  for (const auto& r : s.region_sets()) {
    const bool shm = r.kind() == v1::REGION_KIND_SHM;
    std::cout << fmt::format(
        "region set  {}  {} {} members{}, {:.1f} MB{}  client '{}' ({})  calls {}  in use {}{}\n",
        r.name(), shm ? "shm" : "cuda_ipc", r.members(),
        shm || r.vmm_members() == 0 ? "" : fmt::format(" ({} VMM)", r.vmm_members()),
        r.byte_size() / 1e6, shm ? "" : fmt::format(" on GPU {}", r.device()), r.client(),
        r.owner(), r.calls(), r.in_use(),
        r.lost().empty() ? ""
                         : fmt::format("  LOST members {} (objects shrank; unregister it)",
                                       fmt::join(r.lost(), ",")));
  }
  if (s.channels().empty()) std::cout << "channels    none\n";
  for (const auto& c : s.channels()) {
    std::cout << fmt::format(
        "channel     {}  on {}, areas of {:.1f} MB  client '{}' pid {}  calls {}{}{}\n", c.name(),
        c.key(), c.capacity() / 1e6, c.client(), c.client_pid(), c.calls(),
        c.descriptors() > 0 ? fmt::format("  doorbell ({} descriptors, {} failed)", c.descriptors(),
                                          c.failed_calls())
                            : std::string(),
        c.stopped() ? "  STOPPED (object shrank; close it)" : "");
    if (c.has_tap()) {
      const v1::TapInfo& t = c.tap();
      std::cout << fmt::format(
          "  tap {} ({} pool): calls {}  taps {}  dropped {}  compared {}  refused {}  stack "
          "breaches {}\n"
          "  tap {}: worst rel-L2 custom/reference {:.3g}  stack/reference {:.3g}  "
          "custom/stack {:.3g}\n",
          t.backend(), t.kv_dtype(), t.calls(), t.taps(), t.dropped(), t.compared(), t.refused(),
          t.stack_breaches(), t.backend(), t.worst_custom_vs_reference(),
          t.worst_stack_vs_reference(), t.worst_custom_vs_stack());
    }
    if (c.has_serving_switch()) {
      const v1::SwitchInfo& w = c.serving_switch();
      const std::string age =
          w.lease_age_ms() < 0 ? std::string("no step yet")
                               : fmt::format("lease {:.0f} ms old at the last step ({:.0f} ms ago)",
                                             w.lease_age_ms(), w.since_last_step_ms());
      std::cout << fmt::format(
          "  switch {} ({} layers): asks for {}{}  steps {} (op {}, stack {})  lease of {} ms, "
          "{}  expired {}\n",
          w.model(), w.layers(), w.path(),
          w.path() == "canary" ? fmt::format(" {:.3g}", w.canary_fraction()) : std::string(),
          w.steps(), w.op_steps(), w.steps() - w.op_steps(), w.lease_ms(), age, w.lease_expired());
    }
  }
}

}  // namespace

int RunStatus(const GlobalOptions& g) {
  auto stub = v1::AdminService::NewStub(MakeChannel(g, g.admin));
  v1::GetStatusResponse s;
  auto ctx = MakeContext(g, true);
  grpc::Status st = stub->GetStatus(ctx.get(), v1::GetStatusRequest(), &s);
  if (!st.ok()) return Fail(g, "status", st);
  const auto& r = s.recent();
  const auto& c = s.counters();
  if (g.json) {
    nlohmann::json j = ProtoToJson(s);
    j["audit"] = std::move(j["recent_audit"]);
    j.erase("recent_audit");
    PrintJson(j);
    return 0;
  }
  const auto& rt = s.runtime();
  if (!s.engine().cpu_fallback().empty()) {
    std::cout << fmt::format("WARNING     engine: {}\n", s.engine().cpu_fallback());
  }
  if (!rt.inject_custom_fault().empty()) {
    std::cout << fmt::format(
        "WARNING     TEST-ONLY FAULT INJECTION IS ON: the custom path is made to fail ({})\n",
        rt.inject_custom_fault());
  }
  PrintRollout(s);
  std::cout << fmt::format("engine      {} on {}{}   verifyd {} ({})\n", s.engine().engine(),
                           s.engine().device(),
                           s.engine().compute_capability().empty()
                               ? ""
                               : fmt::format(", sm_{}", s.engine().compute_capability()),
                           s.version(), s.commit());
  std::cout << fmt::format("requests    {} ({} errors), served reference {}, custom {}\n",
                           c.requests(), c.request_errors(), c.served_reference(),
                           c.served_custom());
  std::cout << fmt::format("comparisons match {}, breach {}, error {}, skipped {}\n",
                           c.comparisons_match(), c.comparisons_breach(), c.comparisons_error(),
                           c.comparisons_skipped());
  std::cout << fmt::format(
      "recent {}   rel-L2 custom vs reference mean {} max {}, max-abs {}; breaches {}\n",
      r.comparisons(), Num(r.rel_l2_mean()), Num(r.rel_l2_max()), Num(r.max_abs_max()),
      r.breaches());
  std::cout << fmt::format(
      "oracle ({} samples)   rel-L2 custom vs oracle {}   reference vs oracle {}   custom vs "
      "reference {}\n",
      r.oracle_samples(), Num(r.custom_vs_oracle_rel_l2()), Num(r.reference_vs_oracle_rel_l2()),
      Num(r.rel_l2_mean()));
  PrintDrift(s.drift());
  PrintProbe(s.probe());
  const auto& cap = s.capture();
  std::cout << fmt::format("sampling    shadow {}  custom {}  oracle {}\n", s.shadow_sample_rate(),
                           s.custom_sample_rate(), rt.oracle_sample_rate());
  const auto& tol = rt.tolerances();
  std::cout << fmt::format(
      "tolerances  atol {}  atol_rel {}  rtol {}  max rel-L2 {}  max row rel-L2 {}  max-abs {}  "
      "max lse {}  beyond tol {}{}\n",
      tol.atol(), tol.atol_rel(), tol.rtol(), tol.max_rel_l2(), tol.max_row_rel_l2(), tol.max_abs(),
      tol.max_lse_abs(), tol.max_beyond_tol(),
      rt.custom_timeout_ms() > 0 ? fmt::format("  custom timeout {} ms", rt.custom_timeout_ms())
                                 : "");
  std::cout << fmt::format("rollback    after {} breaches within {} sampled comparisons; gate {}\n",
                           rt.rollback_breaches(), rt.rollback_window(), rt.gate_window());
  std::cout << fmt::format("listening   data {}  admin {}  metrics {}\n",
                           fmt::join(rt.listen(), ", "), rt.admin_listen(),
                           rt.metrics_address().empty() ? "off" : rt.metrics_address());
  PrintRegionsAndChannels(s);
  std::cout << fmt::format("up          {} since {}, state in {}\n", Duration(rt.uptime_seconds()),
                           rt.started(), rt.state_dir());
  std::cout << (cap.dir().empty()
                    ? std::string("captures    off\n")
                    : fmt::format("captures    {} files, {:.1f} MB in {} (pending {}, written {}, "
                                  "dropped {})\n",
                                  cap.files(), cap.bytes() / 1e6, cap.dir(), cap.pending(),
                                  cap.written(), cap.dropped()));
  if (s.has_fleet()) {
    // "generation 3 (in its step): applied custom", "...: custom refused: gate: ...".
    const v1::FleetStatus& f = s.fleet();
    std::string acted = "none acted on";
    if (!f.last_outcome().empty()) {
      acted = fmt::format("generation {} ({}): {}{}", f.generation_acted(),
                          f.in_step() ? "in its step" : "stable",
                          f.last_outcome() == "applied" ? "applied " : "", Clip(f.last_detail()));
    }
    std::cout << fmt::format(
        "fleet       node {} follows {}: {}; {}{}\n", f.node(), f.file(),
        f.source_up() ? "source up" : "SOURCE DOWN (" + Clip(f.source_error()) + ")", acted,
        f.generation_seen() > f.generation_acted()
            ? fmt::format(" (generation {} seen)", f.generation_seen())
            : std::string());
  }
  std::cout << fmt::format(
      "rollbacks   {}{}\n", c.rollbacks(),
      s.last_rollback_reason().empty() ? "" : "   last: " + Clip(s.last_rollback_reason()));
  if (s.recent_audit_size() > 0) std::cout << "audit (newest last)\n";
  for (const auto& a : s.recent_audit()) {
    // The verified peer (uid from the kernel, or the token's hash) first; the name the client
    // gave is only what it claims.
    const std::string by = a.peer().empty()
                               ? a.who()
                               : (a.who().empty() || a.who() == a.peer()
                                      ? a.peer()
                                      : fmt::format("{} (claims {})", a.peer(), a.who()));
    std::cout << fmt::format("  {}  {} -> {}{}  by {}: {}\n", a.time(), ModeStr(a.from()),
                             ModeStr(a.to()), a.forced() ? " (forced)" : "", by, Clip(a.reason()));
  }
  return 0;
}

int RunFlip(const GlobalOptions& g, const FlipOptions& f) {
  v1::SetModeRequest req;
  if (f.mode == "custom") {
    req.set_mode(v1::MODE_CUSTOM);
  } else if (f.mode == "canary") {
    req.set_mode(v1::MODE_CANARY);
    if (f.fraction_given && !(f.fraction > 0 && f.fraction <= 1)) {
      return Fail(g, "flip", "--fraction: canary needs a fraction in (0, 1]");
    }
  } else if (f.mode == "shadow") {
    req.set_mode(v1::MODE_SHADOW);
  } else if (f.mode == "reference") {
    req.set_mode(v1::MODE_REFERENCE);
  } else {
    return Fail(g, "flip", "mode '" + f.mode + "' is not custom, canary, shadow or reference");
  }
  if (f.fraction_given && req.mode() != v1::MODE_CANARY) {
    return Fail(g, "flip", "--fraction: only canary takes a fraction, not " + f.mode);
  }
  if (f.reason.empty()) return Fail(g, "flip", "--reason: say why (it goes to the audit log)");
  req.set_canary_fraction(f.fraction);
  req.set_reason(f.reason);
  req.set_force(f.force);
  req.set_who(Who());
  auto stub = v1::AdminService::NewStub(MakeChannel(g, g.admin));
  v1::SetModeResponse resp;
  auto ctx = MakeContext(g, true);
  grpc::Status st = stub->SetMode(ctx.get(), req, &resp);
  if (!st.ok()) return Fail(g, "flip", st);
  if (g.json) {
    PrintJson({{"mode", ModeStr(resp.mode())},
               {"canary_fraction", resp.canary_fraction()},
               {"forced", resp.forced()}});
  } else {
    std::cout << "mode is now " << ModeStr(resp.mode())
              << (resp.mode() == v1::MODE_CANARY
                      ? fmt::format(" (fraction {})", resp.canary_fraction())
                      : "")
              << (resp.forced() ? " (forced, recorded)" : "") << "\n";
  }
  return 0;
}

int RunRollback(const GlobalOptions& g, const std::string& reason) {
  if (reason.empty()) return Fail(g, "rollback", "--reason: say why (it goes to the audit log)");
  FlipOptions f;
  f.mode = "shadow";
  f.reason = reason;
  return RunFlip(g, f);
}

}  // namespace verifyd::cli

namespace verifyd::cli {

int RunSample(const GlobalOptions& g, const SampleOptions& o) {
  const std::string& mode = o.mode;
  v1::SetSamplingRequest req;
  if (mode == "shadow") {
    req.set_mode(v1::MODE_SHADOW);
  } else if (mode == "custom") {
    req.set_mode(v1::MODE_CUSTOM);
  } else {
    return Fail(g, "sample", "mode '" + mode + "' is not shadow or custom");
  }
  req.set_rate(o.rate);
  req.set_who(Who());
  req.set_reason(o.reason);
  req.set_force(o.force);
  auto stub = v1::AdminService::NewStub(MakeChannel(g, g.admin));
  v1::SetSamplingResponse resp;
  auto ctx = MakeContext(g, true);
  if (grpc::Status st = stub->SetSampling(ctx.get(), req, &resp); !st.ok()) {
    return Fail(g, "sample", st);
  }
  if (g.json) {
    PrintJson({{"shadow_sample_rate", resp.shadow_sample_rate()},
               {"custom_sample_rate", resp.custom_sample_rate()}});
  } else {
    std::cout << fmt::format("sampling: shadow {}  custom {}\n", resp.shadow_sample_rate(),
                             resp.custom_sample_rate());
  }
  return 0;
}

int RunCapture(const GlobalOptions& g, int64_t next) {
  v1::CaptureRequest req;
  req.set_next(next);
  auto stub = v1::AdminService::NewStub(MakeChannel(g, g.admin));
  v1::CaptureResponse resp;
  auto ctx = MakeContext(g, true);
  if (grpc::Status st = stub->Capture(ctx.get(), req, &resp); !st.ok()) {
    return Fail(g, "capture", st);
  }
  const auto& c = resp.capture();
  if (g.json) {
    PrintJson(
        {{"dir", c.dir()}, {"pending", c.pending()}, {"files", c.files()}, {"bytes", c.bytes()}});
  } else {
    std::cout << fmt::format("capturing the next {} compared calls into {} ({} files there)\n",
                             c.pending(), c.dir(), c.files());
  }
  return 0;
}

}  // namespace verifyd::cli

namespace verifyd::cli {

int RunProbe(const GlobalOptions& g) {
  auto stub = v1::AdminService::NewStub(MakeChannel(g, g.admin));
  v1::RunProbesResponse resp;
  auto ctx = MakeContext(g, true);
  if (grpc::Status st = stub->RunProbes(ctx.get(), v1::RunProbesRequest(), &resp); !st.ok()) {
    return Fail(g, "probe", st);
  }
  if (g.json) {
    PrintJson(ProtoToJson(resp));
  } else {
    for (const auto& r : resp.results()) {
      std::cout << fmt::format("{:<4}  {:<24} row rel-L2 {:<9} rel-L2 {:<9} {:.3f} s  {}{}\n",
                               r.passed() ? "ok" : "FAIL", r.name(), Num(r.max_row_rel_l2()),
                               Num(r.rel_l2()), r.seconds(), r.feature(),
                               r.passed() ? "" : ": " + r.reason());
    }
    std::cout << resp.summary() << "\n";
  }
  return resp.passed() ? 0 : 1;
}

}  // namespace verifyd::cli
