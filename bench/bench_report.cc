#include "bench/bench_report.h"

#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"

namespace verifyd::bench {
namespace {

std::string Fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Each e4m3 row beside the bf16 row of the same path, shape and page: the time ratio against
// the targets (<= 0.6 memory-bound, where half the bytes are read; <= 1 compute-bound).
// Empty when the report has no e4m3 row.
std::string E4m3Comparison(const BenchReport& r) {
  std::string s;
  for (const BenchRow& e : r.rows) {
    if (e.kv_dtype != "e4m3") continue;
    const BenchRow* b = nullptr;
    for (const BenchRow& x : r.rows) {
      if (x.kv_dtype == "bf16" && x.path == e.path && x.batch == e.batch && x.draft == e.draft &&
          x.heads == e.heads && x.prefix == e.prefix && x.page_size == e.page_size) {
        b = &x;
      }
    }
    if (b == nullptr || b->ms <= 0 || e.ms <= 0) continue;
    if (s.empty()) {
      s = "\n## e4m3 pools against bf16 (same values, same path)\n\n"
          "| path | B,T,H,prefix | page | bf16 ms | e4m3 ms | e4m3 / bf16 | target |\n"
          "|---|---|---:|---:|---:|---:|---|\n";
    }
    const double ratio = e.ms / b->ms;
    const double target = b->compute_bound ? 1.0 : 0.6;
    s += "| " + e.path + " | " + std::to_string(e.batch) + "," + std::to_string(e.draft) + "," +
         std::to_string(e.heads) + "," + std::to_string(e.prefix) + " | " +
         std::to_string(e.page_size) + " | " + Fmt("%.4f", b->ms) + " | " + Fmt("%.4f", e.ms) +
         " | " + Fmt("%.2f", ratio) + " | " + (ratio <= target ? "met" : "missed") +
         " (<= " + Fmt("%.1f", target) + ") |\n";
  }
  return s;
}

}  // namespace

std::string TargetVerdict(const BenchRow& r) {
  if (r.ms <= 0) return "failed";
  if (r.floor_ms < 0.010) return "-";
  const bool compute = int64_t{r.draft} * r.heads >= 90;
  const bool met = compute ? r.tflops >= 250 : r.gbps >= 2500;
  return std::string(met ? "met" : "missed") + (compute ? " (TFLOP/s)" : " (GB/s)");
}

std::string ToMarkdown(const BenchReport& r) {
  std::string s;
  s += "# verifyd-bench on " + r.device + "\n\n";
  s += "commit `" + r.commit + "`, " + r.date + ", " + std::to_string(r.sms) + " SMs\n\n";
  s += "Ceilings measured in this run: bf16 cuBLAS GEMM " + std::to_string(r.ceilings.gemm_mnk) +
       "^3 " + Fmt("%.1f", r.ceilings.gemm_tflops) + " TFLOP/s; D2D copy of " +
       Fmt("%.2f", r.ceilings.copy_bytes / 1073741824.0) + " GiB " +
       Fmt("%.0f", r.ceilings.copy_gbps) + " GB/s (read + write).\n\n";
  if (!r.ceilings.error.empty()) s += "Ceiling error: " + r.ceilings.error + "\n\n";
  s += "| path | kv | B | T | H | prefix | page | ms | TFLOP/s | GB/s | floor ms | ratio | bound | "
       "splits | rel-L2 vs ref | target |\n";
  s += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|\n";
  for (const BenchRow& x : r.rows) {
    s += "| " + x.path + " | " + x.kv_dtype + " | " + std::to_string(x.batch) + " | " +
         std::to_string(x.draft) + " | " + std::to_string(x.heads) + " | " +
         std::to_string(x.prefix) + " | " + std::to_string(x.page_size) + " | ";
    if (x.ms > 0) {
      s += Fmt("%.4f", x.ms) + " | " + Fmt("%.1f", x.tflops) + " | " + Fmt("%.0f", x.gbps) + " | " +
           Fmt("%.4f", x.floor_ms) + " | " + Fmt("%.2f", x.ms / x.floor_ms) + " | ";
    } else {
      s += "failed: " + x.error + " | | | " + Fmt("%.4f", x.floor_ms) + " | | ";
    }
    s += std::string(x.compute_bound ? "compute" : "memory") + " | " +
         (x.splits > 0 ? std::to_string(x.splits) : std::string("")) + " | " +
         (x.rel_l2_vs_reference >= 0 ? Fmt("%.2e", x.rel_l2_vs_reference) : std::string("")) +
         " | " + TargetVerdict(x) + " |\n";
  }
  s += E4m3Comparison(r);
  return s;
}

std::string ToJson(const BenchReport& r) {
  nlohmann::json j;
  j["device"] = r.device;
  j["commit"] = r.commit;
  j["date"] = r.date;
  j["sms"] = r.sms;
  j["ceilings"] = {{"gemm_tflops", r.ceilings.gemm_tflops},
                   {"gemm_mnk", r.ceilings.gemm_mnk},
                   {"copy_gbps", r.ceilings.copy_gbps},
                   {"copy_bytes", r.ceilings.copy_bytes}};
  j["rows"] = nlohmann::json::array();
  for (const BenchRow& x : r.rows) {
    nlohmann::json row = {{"path", x.path},
                          {"kv_dtype", x.kv_dtype},
                          {"B", x.batch},
                          {"T", x.draft},
                          {"H", x.heads},
                          {"prefix", x.prefix},
                          {"page_size", x.page_size},
                          {"ms", x.ms},
                          {"tflops", x.tflops},
                          {"gbps", x.gbps},
                          {"floor_ms", x.floor_ms},
                          {"ratio", x.ms > 0 ? x.ms / x.floor_ms : 0.0},
                          {"bound", x.compute_bound ? "compute" : "memory"},
                          {"target", TargetVerdict(x)}};
    if (x.splits > 0) row["splits"] = x.splits;
    if (x.rel_l2_vs_reference >= 0) row["rel_l2_vs_reference"] = x.rel_l2_vs_reference;
    if (!x.error.empty()) row["error"] = x.error;
    j["rows"].push_back(row);
  }
  return j.dump(2) + "\n";
}

}  // namespace verifyd::bench
