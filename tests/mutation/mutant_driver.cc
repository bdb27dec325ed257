// Runs an engine's (CPU or CUDA) reference and custom paths on random bundles of each shape
// class and traffic model, judges every call with the one comparison (Judge()), and reports per
// class: calls, breaches, the call of the first breach, which criteria tripped, and the largest
// clean figures. Built against a mutated custom path it measures detection; built against the
// clean one (optionally with --oracle) it measures the clean distributions the defaults come from.
// With --drift every call also runs the fp64 oracle and feeds verifyd's oracle drift test, one
// stream per traffic model (all its classes in order, as a daemon would see them); with
// --probe_max_prefix the probe suite runs once. Both report whether and when they tripped. With
// --determinism_prefix the determinism probe runs once: the custom path on one long
// random-valued bundle, several times, every output bit for bit the first's (the kernel is
// deterministic by contract, so a difference is a race, whatever its size). With
// --invariance_max_prefix the invariance probes' full sweep runs once: the custom path against
// itself under other split plans, page sizes, page orders, batches and draft-block starts. With
// --kv_dtype e4m3 every class's pool is e4m3 at --kv_scale (README.md, "FP8 KV caches").

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"
#include "src/bundle/random_bundle.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/control/drift_test.h"
#include "src/engine/engine_factory.h"
#include "src/probe/invariance.h"
#include "src/probe/probe_runner.h"
#include "src/probe/probe_suite.h"

namespace verifyd {
namespace {

using json = nlohmann::ordered_json;

struct Options {
  std::string label = "clean";
  std::string commit = "unknown";
  std::string traffic = "random,realistic";
  std::string prefixes = "512,4096,16384,65536";
  std::string pages = "1,64";
  std::string drafts = "4,16,64";
  int heads = 2;
  int batch = 1;
  bool ragged = false;  // each request its own prefix: the class's prefix plus (37 b mod 64) - 32
  int calls = 20;       // most calls per class
  double budget = 4e6;  // per class: calls <= budget / (T * kv_len), at least min_calls
  int min_calls = 1;
  uint64_t seed = 1;
  std::string kv_dtype = "bf16";  // the pools of the classes: bf16 or e4m3 (at kv_scale)
  float kv_scale = 1.f;
  bool oracle = false;                // also measure both paths against the fp64 oracle
  bool drift = false;                 // feed the oracle drift test (runs the oracle on every call)
  int64_t probe_max_prefix = 0;       // > 0: run the probe suite with this longest prefix
  int64_t determinism_prefix = 0;     // > 0: run the determinism probe at this prefix
  int determinism_runs = 4;           // custom-path runs of its bundle, compared with the first
  int64_t invariance_max_prefix = 0;  // > 0: run the invariance probes' full sweep, so sized
  bool invariance_fast = false;       // the periodic probe's subset instead of the full sweep
  bool fail_on_breach = false;
  int threads = 0;
  std::string engine = "cpu";
  std::string json_path;
  Tolerance tol;
};

// The criterion a part of Judge()'s reason names.
std::string Criterion(const std::string& part) {
  if (part.rfind("row rel_l2", 0) == 0) return "row_rel_l2";
  if (part.rfind("rel_l2", 0) == 0) return "rel_l2";
  if (part.rfind("nonzero output", 0) == 0) return "zero_row";
  if (part.rfind("beyond_tol", 0) == 0) return "element";
  if (part.rfind("max_abs", 0) == 0) return "max_abs";
  if (part.rfind("lse", 0) == 0) return "lse";
  return "nonfinite";
}

// The smallest atol_rel under which every element of a comparison passes at the given rtol:
// max over elements of (|test - ref| - rtol |ref|) / rms(ref row), over rows that are not all zero.
template <typename RefAt>
double NeededAtolRel(const std::vector<uint16_t>& test, RefAt ref_at, double rtol) {
  double need = 0;
  const int64_t n = static_cast<int64_t>(test.size());
  for (int64_t begin = 0; begin < n; begin += kCompareRowLen) {
    const int64_t m = std::min(kCompareRowLen, n - begin);
    double sq = 0;
    for (int64_t k = 0; k < m; ++k) sq += ref_at(begin + k) * ref_at(begin + k);
    const double rms = std::sqrt(sq / static_cast<double>(m));
    if (rms == 0) continue;
    for (int64_t k = 0; k < m; ++k) {
      const double r = ref_at(begin + k), t = Bf16ToFloat(test[begin + k]);
      need = std::max(need, (std::fabs(t - r) - rtol * std::fabs(r)) / rms);
    }
  }
  return need;
}

// Largest values seen over a class's calls.
struct Maxima {
  std::map<std::string, double> v;
  void Take(const std::string& k, double x) {
    if (std::isnan(x)) return;
    auto [it, fresh] = v.emplace(k, x);
    if (!fresh) it->second = std::max(it->second, x);
  }
};

struct ClassResult {
  Traffic traffic = Traffic::kRandom;
  kernels::KvDtype kv_dtype = kernels::KvDtype::kBf16;
  float kv_scale = 1.f;
  int64_t prefix = 0;
  int batch = 1, page = 0, draft = 0, calls = 0, breaches = 0;
  bool ragged = false;
  int first_breach = 0;  // the call of the first breach, 1-based; 0: none
  std::map<std::string, int> criteria;
  std::string first_reason;
  Maxima max;
};

// One traffic model's oracle drift stream.
struct DriftStream {
  explicit DriftStream(const DriftOptions& d) : test(d) {}
  DriftTest test;
  int64_t samples = 0, breach_samples = 0;
  int64_t first_breach = 0;  // the sample of the first breach, 1-based; 0: none
  double max_ratio = 0;
};

absl::StatusOr<ClassResult> RunClass(Engine& engine, const Options& o, Traffic traffic,
                                     int64_t prefix, int page, int draft, uint64_t seed,
                                     DriftStream* drift) {
  ClassResult c;
  c.traffic = traffic;
  c.kv_dtype = o.kv_dtype == "e4m3" ? kernels::KvDtype::kE4m3 : kernels::KvDtype::kBf16;
  c.kv_scale = c.kv_dtype == kernels::KvDtype::kE4m3 ? o.kv_scale : 1.f;
  c.batch = o.batch;
  c.ragged = o.ragged;
  c.prefix = prefix;
  c.page = page;
  c.draft = draft;
  const double work = static_cast<double>(draft) * static_cast<double>(prefix + draft);
  // Clamped as a double: a large budget over a small class must not overflow the int.
  const int calls = static_cast<int>(std::clamp(
      std::floor(o.budget / work), static_cast<double>(o.min_calls), static_cast<double>(o.calls)));
  for (int call = 0; call < calls; ++call) {
    RandomBundleSpec spec;
    spec.batch = o.batch;
    spec.draft = draft;
    spec.heads = o.heads;
    spec.page_size = page;
    spec.prefix = prefix;
    if (o.ragged) {
      for (int b = 0; b < o.batch; ++b) {
        spec.prefix_lens.push_back(std::max<int64_t>(0, prefix + (37 * b) % 64 - 32));
      }
    }
    spec.traffic = traffic;
    spec.kv_dtype = c.kv_dtype;
    spec.kv_scale = c.kv_scale;
    spec.seed = seed + static_cast<uint64_t>(call);
    RandomBundle rb(spec);
    auto pb = engine.Prepare(rb.view(), /*detach=*/false);
    if (!pb.ok()) return pb.status();
    PreparedBundle& b = **pb;
    for (Path p : {Path::kReference, Path::kCustom}) {
      if (absl::Status st = engine.Run(p, b); !st.ok()) return st;
    }
    auto d = engine.Compare(b, Path::kCustom, Path::kReference, o.tol);
    if (!d.ok()) return d.status();
    const Verdict v = Judge(*d, o.tol);
    ++c.calls;
    if (!v.match) {
      ++c.breaches;
      if (c.first_breach == 0) {
        c.first_breach = call + 1;
        c.first_reason = v.reason;
      }
      for (absl::string_view part : absl::StrSplit(v.reason, "; ")) {
        ++c.criteria[Criterion(std::string(part))];
      }
    }
    c.max.Take("rel_l2", d->rel_l2);
    c.max.Take("max_row_rel_l2", d->max_row_rel_l2);
    c.max.Take("max_abs", d->max_abs);
    c.max.Take("lse_max_abs", d->lse_max_abs);
    c.max.Take("beyond_tol", static_cast<double>(d->beyond_tol));
    PathOutput cus, ref;
    if (absl::Status st = engine.Fetch(Path::kCustom, b, &cus); !st.ok()) return st;
    if (absl::Status st = engine.Fetch(Path::kReference, b, &ref); !st.ok()) return st;
    c.max.Take("atol_rel_needed",
               NeededAtolRel(
                   cus.o, [&](int64_t i) { return double{Bf16ToFloat(ref.o[i])}; }, o.tol.rtol));
    if (drift != nullptr) {
      if (absl::Status st = engine.Run(Path::kOracle, b); !st.ok()) return st;
      auto cd = engine.Compare(b, Path::kCustom, Path::kOracle, o.tol);
      auto rd = engine.Compare(b, Path::kReference, Path::kOracle, o.tol);
      if (!cd.ok()) return cd.status();
      if (!rd.ok()) return rd.status();
      const DriftReading r = drift->test.Add(cd->rel_l2, rd->rel_l2);
      ++drift->samples;
      if (std::isfinite(r.ratio)) drift->max_ratio = std::max(drift->max_ratio, r.ratio);
      if (r.breach) {
        ++drift->breach_samples;
        if (drift->first_breach == 0) drift->first_breach = drift->samples;
      }
    }
    if (o.oracle) {
      if (absl::Status st = engine.Run(Path::kOracle, b); !st.ok()) return st;
      PathOutput ora;
      if (absl::Status st = engine.Fetch(Path::kOracle, b, &ora); !st.ok()) return st;
      auto ora_at = [&](int64_t i) { return double{ora.o_f32[i]}; };
      for (auto [name, path, out] : {std::tuple{"custom_vs_oracle", Path::kCustom, &cus},
                                     std::tuple{"reference_vs_oracle", Path::kReference, &ref}}) {
        auto od = engine.Compare(b, path, Path::kOracle, o.tol);
        if (!od.ok()) return od.status();
        c.max.Take(fmt::format("{}.rel_l2", name), od->rel_l2);
        c.max.Take(fmt::format("{}.max_row_rel_l2", name), od->max_row_rel_l2);
        c.max.Take(fmt::format("{}.atol_rel_needed", name),
                   NeededAtolRel(out->o, ora_at, o.tol.rtol));
      }
    }
  }
  return c;
}

template <typename T>
bool ParseList(const std::string& s, std::vector<T>* out) {
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    T v;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return !out->empty();
}

json ToJson(const ClassResult& c) {
  json j = {{"traffic", TrafficName(c.traffic)},
            {"kv_dtype", kernels::KvDtypeName(c.kv_dtype)},
            {"kv_scale", c.kv_scale},
            {"batch", c.batch},
            {"ragged", c.ragged},
            {"prefix", c.prefix},
            {"page_size", c.page},
            {"draft", c.draft},
            {"calls", c.calls},
            {"breaches", c.breaches},
            {"breach_fraction", c.calls ? double(c.breaches) / c.calls : 0.0}};
  j["first_breach_call"] = c.first_breach ? json(c.first_breach) : json(nullptr);
  j["criteria"] = c.criteria;
  j["first_reason"] = c.first_reason;
  j["max"] = c.max.v;
  return j;
}

void AddFlags(CLI::App& app, Options* o) {
  app.add_option("--label", o->label, "name of the build (the mutant)");
  app.add_option("--commit", o->commit, "commit the build is from");
  app.add_option("--traffic", o->traffic, "traffic models, comma-separated");
  app.add_option("--prefixes", o->prefixes, "prefix lengths, comma-separated");
  app.add_option("--pages", o->pages, "page sizes, comma-separated");
  app.add_option("--drafts", o->drafts, "draft lengths T, comma-separated");
  app.add_option("--heads", o->heads, "heads")->check(CLI::Range(1, 128));
  app.add_option("--batch", o->batch, "requests per bundle")->check(CLI::Range(1, 64));
  app.add_flag("--ragged", o->ragged,
               "each request its own prefix, the class's plus (37 b mod 64) - 32: draft blocks "
               "at every offset of a tile");
  app.add_option("--calls", o->calls, "most calls per class")->check(CLI::Range(1, 1 << 30));
  app.add_option("--budget", o->budget, "per class: calls <= budget / (T * kv_len)");
  app.add_option("--min_calls", o->min_calls, "fewest calls per class")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--seed", o->seed, "seed of the first bundle");
  app.add_option("--kv_dtype", o->kv_dtype, "the classes' KV pools: bf16, or e4m3 at --kv_scale")
      ->check(CLI::IsMember({"bf16", "e4m3"}));
  app.add_option("--kv_scale", o->kv_scale, "an e4m3 pool's kv_scale")->check(CLI::PositiveNumber);
  app.add_flag("--oracle", o->oracle, "also compare both paths with the fp64 oracle");
  app.add_flag("--drift", o->drift,
               "feed the oracle drift test, one stream per traffic model (runs the oracle)");
  app.add_option("--probe_max_prefix", o->probe_max_prefix,
                 "run the probe suite with this longest prefix (0: not)");
  app.add_option("--determinism_prefix", o->determinism_prefix,
                 "run the determinism probe on a bundle with this prefix (0: not)");
  app.add_option("--determinism_runs", o->determinism_runs,
                 "custom-path runs of the determinism probe's bundle")
      ->check(CLI::Range(2, 1000));
  app.add_option("--invariance_max_prefix", o->invariance_max_prefix,
                 "run the invariance probes' full sweep on cases sized for this prefix (0: not)");
  app.add_flag("--invariance_fast", o->invariance_fast,
               "with --invariance_max_prefix: the periodic probe's subset, not the full sweep");
  app.add_flag("--fail_on_breach", o->fail_on_breach,
               "exit 1 when any call breaches, the drift test trips or a probe fails");
  app.add_option("--engine", o->engine, "cpu or cuda (a build with the CUDA engine)");
  app.add_option("--threads", o->threads, "CPU engine threads (0: all cores)");
  app.add_option("--json", o->json_path, "write the results here");
  app.add_option("--atol", o->tol.atol, "element check: absolute part");
  app.add_option("--atol_rel", o->tol.atol_rel, "element check: part relative to the row's rms");
  app.add_option("--rtol", o->tol.rtol, "element check: relative part");
  app.add_option("--max_rel_l2", o->tol.max_rel_l2, "global rel-L2 limit");
  app.add_option("--max_row_rel_l2", o->tol.max_row_rel_l2, "per-row rel-L2 limit");
  app.add_option("--max_lse_abs", o->tol.max_lse_abs, "lse limit (natural log)");
}

// The classes to run: every traffic model x prefix x page size x draft length.
struct ClassGrid {
  std::vector<Traffic> traffics;
  std::vector<int64_t> prefixes;
  std::vector<int> pages, drafts;
};

// False (after saying which) when a list flag does not parse.
bool ParseGrid(const Options& o, ClassGrid* grid) {
  std::vector<std::string> traffic_names = absl::StrSplit(o.traffic, ',');
  for (const auto& name : traffic_names) {
    Traffic t;
    if (!ParseTraffic(name, &t)) {
      std::cerr << "--traffic: random or realistic, got '" << name << "'\n";
      return false;
    }
    grid->traffics.push_back(t);
  }
  if (!ParseList(o.prefixes, &grid->prefixes)) return std::cerr << "--prefixes: integers\n", false;
  if (!ParseList(o.pages, &grid->pages)) return std::cerr << "--pages: integers\n", false;
  if (!ParseList(o.drafts, &grid->drafts)) return std::cerr << "--drafts: integers\n", false;
  return true;
}

// What the classes found, over all of them.
struct Totals {
  json classes = json::array();
  int64_t calls = 0, breaches = 0;
  json drift = json::object();  // per traffic model, with --drift
  bool drift_tripped = false;
};

void PrintClass(const Options& o, Traffic t, ClassResult& c) {
  const std::string traffic = c.kv_dtype == kernels::KvDtype::kE4m3
                                  ? fmt::format("{} e4m3x{:g}", TrafficName(t), c.kv_scale)
                                  : std::string(TrafficName(t));
  std::cout << fmt::format(
      "{:<28} {:<9} prefix {:>6} page {:>2} T {:>2}: {:>3}/{:<3} breached, first {}  "
      "row rel-L2 max {:.3g}  atol_rel needed {:.3g}  {}\n",
      o.label, traffic, c.prefix, c.page, c.draft, c.breaches, c.calls, c.first_breach,
      c.max.v["max_row_rel_l2"], c.max.v["atol_rel_needed"], c.first_reason);
  std::cout.flush();
}

void ReportDrift(const Options& o, Traffic t, const DriftStream& drift, Totals* totals) {
  totals->drift_tripped |= drift.first_breach > 0;
  std::cout << fmt::format("{:<28} {:<9} drift: {} samples, first breach {}, ratio max {:.3g}\n",
                           o.label, TrafficName(t), drift.samples, drift.first_breach,
                           drift.max_ratio);
  json d = {{"samples", drift.samples},
            {"breach_samples", drift.breach_samples},
            {"max_ratio", drift.max_ratio}};
  d["first_breach_sample"] = drift.first_breach ? json(drift.first_breach) : json(nullptr);
  totals->drift[TrafficName(t)] = d;
}

// Every class of the grid, one drift stream per traffic model; false (after saying why) when the
// engine failed on a class.
bool RunClasses(Engine& engine, const Options& o, const ClassGrid& grid, Totals* totals) {
  uint64_t class_seed = o.seed;
  for (Traffic t : grid.traffics) {
    DriftStream drift{DriftOptions{}};
    for (int64_t prefix : grid.prefixes) {
      for (int page : grid.pages) {
        for (int draft : grid.drafts) {
          class_seed += 1000003;
          auto c =
              RunClass(engine, o, t, prefix, page, draft, class_seed, o.drift ? &drift : nullptr);
          if (!c.ok()) {
            std::cerr << o.label << ": " << c.status() << "\n";
            return false;
          }
          totals->calls += c->calls;
          totals->breaches += c->breaches;
          PrintClass(o, t, *c);
          totals->classes.push_back(ToJson(*c));
        }
      }
    }
    if (o.drift) ReportDrift(o, t, drift, totals);
  }
  return true;
}

// The probe suite once, with --probe_max_prefix; false (after saying why) when its options are
// invalid.
bool RunProbes(Engine& engine, const Options& o, json* probe_doc, bool* probe_failed) {
  ProbeSuiteOptions po;
  po.max_prefix = o.probe_max_prefix;
  if (absl::Status st = ValidateProbeSuiteOptions(po); !st.ok()) {
    std::cerr << st.message() << "\n";
    return false;
  }
  const ProbeReport r = RunProbeSuite(engine, BuildProbeSuite(po), o.tol);
  *probe_failed = !r.passed();
  json failed = json::array();
  std::string first_reason;
  for (const ProbeResult& p : r.results) {
    if (p.passed) continue;
    failed.push_back(p.name);
    if (first_reason.empty()) first_reason = p.name + ": " + p.reason;
  }
  *probe_doc = {{"max_prefix", o.probe_max_prefix}, {"probes", r.results.size()},
                {"failures", r.failures},           {"failed", failed},
                {"first_reason", first_reason},     {"seconds", r.seconds}};
  std::cout << fmt::format("{:<28} probe: {}\n", o.label, r.Summary());
  return true;
}

// The determinism probe, with --determinism_prefix: one long random-valued bundle (B = 8, T = 16,
// H = 16, page 64, a random tree; long enough for many KV splits and steps per CTA), the custom
// path run --determinism_runs times, each output (o and lse, as bits) against the first run's.
// False (after saying why) when the engine failed.
bool RunDeterminism(Engine& engine, const Options& o, json* doc, bool* differed) {
  RandomBundleSpec spec;
  spec.batch = 8;
  spec.draft = 16;
  spec.heads = 16;
  spec.page_size = 64;
  spec.prefix = o.determinism_prefix;
  spec.traffic = Traffic::kRandom;
  spec.seed = o.seed + 17;
  RandomBundle rb(spec);
  auto pb = engine.Prepare(rb.view(), /*detach=*/false);
  if (!pb.ok()) {
    std::cerr << o.label << ": determinism: " << pb.status() << "\n";
    return false;
  }
  PathOutput first, again;
  int differing_runs = 0;
  int64_t differing_o = 0, differing_lse = 0;
  int first_differing_run = 0;
  for (int run = 0; run < o.determinism_runs; ++run) {
    PathOutput& out = run == 0 ? first : again;
    absl::Status st = engine.Run(Path::kCustom, **pb);
    if (st.ok()) st = engine.Fetch(Path::kCustom, **pb, &out);
    if (!st.ok()) {
      std::cerr << o.label << ": determinism: " << st << "\n";
      return false;
    }
    if (run == 0) continue;
    int64_t d_o = 0, d_lse = 0;
    for (size_t i = 0; i < out.o.size() && i < first.o.size(); ++i) d_o += out.o[i] != first.o[i];
    for (size_t i = 0; i < out.lse.size() && i < first.lse.size(); ++i) {
      d_lse += std::memcmp(&out.lse[i], &first.lse[i], sizeof(float)) != 0;
    }
    if (d_o + d_lse > 0 || out.o.size() != first.o.size()) {
      ++differing_runs;
      if (first_differing_run == 0) first_differing_run = run + 1;
      differing_o = std::max(differing_o, d_o);
      differing_lse = std::max(differing_lse, d_lse);
    }
  }
  *differed = differing_runs > 0;
  *doc = {{"prefix", o.determinism_prefix},
          {"batch", spec.batch},
          {"draft", spec.draft},
          {"heads", spec.heads},
          {"page_size", spec.page_size},
          {"runs", o.determinism_runs},
          {"differing_runs", differing_runs},
          {"max_differing_o", differing_o},
          {"max_differing_lse", differing_lse}};
  (*doc)["first_differing_run"] = first_differing_run ? json(first_differing_run) : json(nullptr);
  std::cout << fmt::format(
      "{:<28} determinism: {} of {} runs differ from the first (up to {} o and {} lse elements)\n",
      o.label, differing_runs, o.determinism_runs - 1, differing_o, differing_lse);
  return true;
}

// The invariance probes' full sweep once, with --invariance_max_prefix: the custom path against
// itself (src/probe/invariance.h), no reference.
void RunInvariance(Engine& engine, const Options& o, json* doc, bool* failed) {
  const CustomRunner runner = EngineCustomRunner(engine);
  json checks = json::array(), failed_names = json::array();
  std::string first_reason;
  int n = 0, failures = 0, runs = 0;
  double seconds = 0;
  for (const InvarianceCase& c : InvarianceCases(o.invariance_max_prefix, runner.tile_tokens)) {
    const InvarianceSweep sweep =
        o.invariance_fast ? InvarianceSweep::kFast : InvarianceSweep::kFull;
    for (const InvarianceResult& r : RunInvarianceChecks(runner, c, sweep)) {
      ++n;
      runs += r.runs;
      seconds += r.seconds;
      const RowAgreement& a = r.agreement;
      checks.push_back(
          {{"name", r.name},
           {"passed", r.passed},
           {"runs", r.runs},
           {"rows", a.rows},
           {"bit_identical", a.exact()},
           {"max_row_rel_l2",
            std::isfinite(a.max_row_rel_l2) ? json(a.max_row_rel_l2) : json(nullptr)},
           {"max_lse_abs", std::isfinite(a.max_lse_abs) ? json(a.max_lse_abs) : json(nullptr)},
           {"seconds", r.seconds},
           {"reason", r.reason}});
      if (r.passed) continue;
      ++failures;
      failed_names.push_back(r.name);
      if (first_reason.empty()) first_reason = r.name + ": " + r.reason;
    }
  }
  *failed = failures > 0;
  *doc = {{"max_prefix", o.invariance_max_prefix},
          {"checks", n},
          {"failures", failures},
          {"failed", failed_names},
          {"first_reason", first_reason},
          {"runs", runs},
          {"seconds", seconds},
          {"detail", checks}};
  std::cout << fmt::format("{:<28} invariance: {} of {} checks failed ({} runs, {:.3g} s){}{}\n",
                           o.label, failures, n, runs, seconds, failures ? ": " : "", first_reason);
}

void WriteJson(const Options& o, const EngineInfo& info, const Totals& totals,
               const json& probe_doc, const json& determinism_doc, const json& invariance_doc) {
  json doc = {{"label", o.label},
              {"commit", o.commit},
              {"engine", info.engine},
              {"device", info.device},
              {"heads", o.heads},
              {"batch", o.batch},
              {"tolerance",
               {{"atol", o.tol.atol},
                {"atol_rel", o.tol.atol_rel},
                {"rtol", o.tol.rtol},
                {"max_rel_l2", o.tol.max_rel_l2},
                {"max_row_rel_l2", o.tol.max_row_rel_l2},
                {"max_abs", o.tol.max_abs},
                {"max_lse_abs", o.tol.max_lse_abs},
                {"max_beyond_tol", o.tol.max_beyond_tol}}},
              {"calls", totals.calls},
              {"breaches", totals.breaches},
              {"classes", totals.classes}};
  if (o.drift) doc["drift"] = totals.drift;
  if (o.probe_max_prefix > 0) doc["probe"] = probe_doc;
  if (o.determinism_prefix > 0) doc["determinism"] = determinism_doc;
  if (o.invariance_max_prefix > 0) doc["invariance"] = invariance_doc;
  std::ofstream(o.json_path) << doc.dump(1) << "\n";
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"reference vs custom on an engine over shape classes and traffic models"};
  AddFlags(app, &o);
  CLI11_PARSE(app, argc, argv);
  ClassGrid grid;
  if (!ParseGrid(o, &grid)) return 2;

  EngineOptions eo;
  eo.kind = o.engine;
  eo.cpu_threads = o.threads;
  auto made = MakeEngine(eo);
  if (!made.ok()) {
    std::cerr << o.label << ": " << made.status().message() << "\n";
    return 2;
  }
  std::unique_ptr<Engine> engine = std::move(*made);
  const EngineInfo info = engine->Info();
  Totals totals;
  if (!RunClasses(*engine, o, grid, &totals)) return 1;
  json probe_doc = nullptr;
  bool probe_failed = false;
  if (o.probe_max_prefix > 0 && !RunProbes(*engine, o, &probe_doc, &probe_failed)) return 2;
  json determinism_doc = nullptr;
  bool differed = false;
  if (o.determinism_prefix > 0 && !RunDeterminism(*engine, o, &determinism_doc, &differed)) {
    return 1;
  }
  json invariance_doc = nullptr;
  bool invariance_failed = false;
  if (o.invariance_max_prefix > 0) RunInvariance(*engine, o, &invariance_doc, &invariance_failed);
  std::cout << fmt::format("{}: {} breaches in {} calls\n", o.label, totals.breaches, totals.calls);
  if (!o.json_path.empty()) WriteJson(o, info, totals, probe_doc, determinism_doc, invariance_doc);
  const bool breached =
      totals.breaches > 0 || totals.drift_tripped || probe_failed || differed || invariance_failed;
  return o.fail_on_breach && breached ? 1 : 0;
}

}  // namespace
}  // namespace verifyd

int main(int argc, char** argv) { return verifyd::Main(argc, argv); }
