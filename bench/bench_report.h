#pragma once
// verifyd-bench's result rows and their markdown and JSON forms:
// {"device", "commit", "date", "ceilings": {...}, "rows": [{"path", "B", "T", "H", "prefix",
//  "kv_dtype", "page_size", "ms", "tflops", "gbps", "floor_ms", ...}]}

#include <cstdint>
#include <string>
#include <vector>

#include "bench/ceilings.h"

namespace verifyd::bench {

struct BenchRow {
  // "custom" (as shipped), "custom-sm120cfg" (as shipped with the sm_120 tiles forced),
  // "custom-" + a schedule's name (kernels/custom/custom_schedule.h), or "reference"
  std::string path;
  std::string kv_dtype = "bf16";  // the pool as sent: "bf16", or "e4m3" (dequantised first)
  int batch = 0, draft = 0, heads = 0, page_size = 0;
  int64_t prefix = 0;
  double ms = 0;                    // median; <= 0 when the path failed
  double tflops = 0;                // sum_b 2*T*H*kv_len_b*(576+512) / time
  double gbps = 0;                  // (KV bytes read once, in kv_dtype, + q + o) / time
  double floor_ms = 0;              // max(flops / GEMM ceiling, bytes / copy ceiling)
  bool compute_bound = false;       // the floor's larger term is the arithmetic one
  int splits = 0;                   // custom paths: KV split the planner chose
  double rel_l2_vs_reference = -1;  // custom paths when the reference ran; -1 otherwise
  std::string error;
};

struct BenchReport {
  std::string device, commit, date;
  int sms = 0;
  Ceilings ceilings;
  std::vector<BenchRow> rows;
};

// Issue-3 targets for shapes whose floor is at least 10 us: compute-bound (T*H >= 90)
// >= 250 TFLOP/s, memory-bound >= 2.5 TB/s. "-" when the floor is under 10 us.
std::string TargetVerdict(const BenchRow& r);

std::string ToMarkdown(const BenchReport& r);
std::string ToJson(const BenchReport& r);

}  // namespace verifyd::bench
