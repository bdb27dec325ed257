#include "src/replay/replay_command.h"

#include <cmath>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "fmt/format.h"
#include "src/bundle/validate.h"
#include "src/compare/compare.h"
#include "src/engine/engine_factory.h"
#include "src/io/bundle_file.h"

namespace verifyd::cli {
namespace {

using nlohmann::json;

json StatsJson(const DiffStats& d, const Verdict& v) {
  auto num = [](double x) { return std::isfinite(x) ? json(x) : json(); };
  return {{"rel_l2", num(d.rel_l2)},
          {"max_abs", num(d.max_abs)},
          {"nmse", num(d.nmse)},
          {"beyond_tol", d.beyond_tol},
          {"nan_test", d.nan_test},
          {"nan_ref", d.nan_ref},
          {"lse_max_abs", num(d.lse_max_abs)},
          {"max_row_rel_l2", num(d.max_row_rel_l2)},
          {"worst_row", d.worst_row},
          {"zero_row_breaches", d.zero_row_breaches},
          {"match", v.match},
          {"reason", v.reason}};
}

std::string StatsLine(const DiffStats& d, const Verdict& v) {
  return fmt::format("rel-L2 {:.4g}  row rel-L2 {:.4g}  max-abs {:.4g}  lse {:.3g}  {}", d.rel_l2,
                     d.max_row_rel_l2, d.max_abs, d.lse_max_abs,
                     v.match ? "match" : "BREACH: " + v.reason);
}

// The capture's tolerance when recorded, else the defaults.
Tolerance ToleranceOf(const BundleFile& f) {
  Tolerance t;
  const auto& m = f.metadata();
  auto get = [&](const char* key, double* out) {
    auto it = m.find(key);
    if (it != m.end()) absl::SimpleAtod(it->second, out);
  };
  get("tol_atol", &t.atol);
  get("tol_rtol", &t.rtol);
  get("tol_max_rel_l2", &t.max_rel_l2);
  get("tol_max_abs", &t.max_abs);
  get("tol_max_lse_abs", &t.max_lse_abs);
  get("tol_atol_rel", &t.atol_rel);  // absent in older captures: the defaults
  get("tol_max_row_rel_l2", &t.max_row_rel_l2);
  if (auto it = m.find("tol_max_beyond_tol"); it != m.end()) {
    absl::SimpleAtoi(it->second, &t.max_beyond_tol);
  }
  return t;
}

// "PATH: message", unless the message already starts with the path (file errors name it).
std::string AboutFile(const std::string& path, absl::string_view message) {
  return absl::StartsWith(message, path + ":") ? std::string(message)
                                               : absl::StrCat(path, ": ", message);
}

bool SameBytes(const std::vector<uint16_t>& a, const Tensor* t) {
  return t && t->data.size() == a.size() * 2 && std::equal(a.begin(), a.end(), t->as<uint16_t>());
}

// The three paths' outputs on one bundle, re-run here.
struct Rerun {
  PathOutput ref, cus, ora;
};

absl::Status RunPaths(Engine& engine, const BundleView& v, Rerun* out) {
  auto prepared = engine.Prepare(v, false);
  absl::Status st = prepared.status();
  for (auto [p, o] : {std::pair{Path::kReference, &out->ref}, std::pair{Path::kCustom, &out->cus},
                      std::pair{Path::kOracle, &out->ora}}) {
    if (st.ok()) st = engine.Run(p, **prepared);
    if (st.ok()) st = engine.Fetch(p, **prepared, o);
  }
  return st;
}

// A file that could not be replayed: its entry's error, also on stderr unless the output is JSON.
void FileError(const GlobalOptions& g, const std::string& path, absl::string_view message,
               json* out) {
  (*out)["error"] = AboutFile(path, message);
  if (!g.json) std::cerr << "verifyd-replay: " << (*out)["error"].get<std::string>() << "\n";
}

// The re-run's comparisons: custom vs reference, and both against the oracle.
void CompareRerun(const GlobalOptions& g, const std::string& path, const EngineInfo& info,
                  const BundleView& v, const Tolerance& tol, const Rerun& x, json* out) {
  const int64_t n = v.o_elems(), nl = v.lse_elems();
  const DiffStats cvr =
      CompareBf16(x.cus.o.data(), x.ref.o.data(), n, x.cus.lse.data(), x.ref.lse.data(), nl, tol);
  const DiffStats cvo = CompareBf16ToF32(x.cus.o.data(), x.ora.o_f32.data(), n, x.cus.lse.data(),
                                         x.ora.lse.data(), nl, tol);
  const DiffStats rvo = CompareBf16ToF32(x.ref.o.data(), x.ora.o_f32.data(), n, x.ref.lse.data(),
                                         x.ora.lse.data(), nl, tol);
  (*out)["shape"] = {{"B", v.shape.batch},
                     {"T", v.shape.draft},
                     {"H", v.shape.heads},
                     {"page_size", v.shape.page_size},
                     {"max_kv_len", v.max_kv_len}};
  (*out)["custom_vs_reference"] = StatsJson(cvr, Judge(cvr, tol));
  (*out)["custom_vs_oracle"] = StatsJson(cvo, Judge(cvo, tol));
  (*out)["reference_vs_oracle"] = StatsJson(rvo, Judge(rvo, tol));
  if (!g.json) {
    std::cout << fmt::format("{}  B={} T={} H={} page_size={} max_kv_len={}  ({} engine)\n", path,
                             v.shape.batch, v.shape.draft, v.shape.heads, v.shape.page_size,
                             v.max_kv_len, info.engine);
    std::cout << "  re-run custom vs reference    " << StatsLine(cvr, Judge(cvr, tol)) << "\n";
    std::cout << "  re-run custom vs oracle       " << StatsLine(cvo, Judge(cvo, tol)) << "\n";
    std::cout << "  re-run reference vs oracle    " << StatsLine(rvo, Judge(rvo, tol)) << "\n";
  }
}

// A capture: the recorded comparison, recomputed from the recorded outputs.
void CompareRecorded(const GlobalOptions& g, const BundleFile& f, const Tolerance& tol,
                     const Rerun& x, json* out) {
  const int64_t n = f.view.o_elems(), nl = f.view.lse_elems();
  const Tensor* rec_ref = f.Find("o_reference");
  const Tensor* rec_cus = f.Find("o_custom");
  if (!rec_ref || !rec_cus || rec_ref->data.size() != static_cast<size_t>(n) * 2 ||
      rec_cus->data.size() != rec_ref->data.size()) {
    return;
  }
  const Tensor* lr = f.Find("lse_reference");
  const Tensor* lc = f.Find("lse_custom");
  const bool lse_ok = lr && lc && lr->data.size() == static_cast<size_t>(nl) * 4 &&
                      lc->data.size() == lr->data.size();
  const DiffStats rec = CompareBf16(rec_cus->as<uint16_t>(), rec_ref->as<uint16_t>(), n,
                                    lse_ok ? lc->as<float>() : nullptr,
                                    lse_ok ? lr->as<float>() : nullptr, lse_ok ? nl : 0, tol);
  double meta_rel = NAN;
  if (auto it = f.metadata().find("rel_l2"); it != f.metadata().end()) {
    absl::SimpleAtod(it->second, &meta_rel);
  }
  // Exact on the CPU engine; the CUDA engine's device reduction sums in another order.
  const bool matches_metadata = std::fabs(rec.rel_l2 - meta_rel) <= 1e-9 * std::fabs(meta_rel);
  const bool ref_same = SameBytes(x.ref.o, rec_ref), cus_same = SameBytes(x.cus.o, rec_cus);
  // Reproduced: the local re-run gave both recorded outputs bit for bit, so the recorded
  // comparison is what this build computes now.
  const bool reproduced = ref_same && cus_same;
  (*out)["recorded"] = StatsJson(rec, Judge(rec, tol));
  (*out)["recorded"]["metadata_rel_l2"] = std::isfinite(meta_rel) ? json(meta_rel) : json();
  (*out)["recorded"]["matches_metadata"] = matches_metadata;
  (*out)["rerun_equals_recorded"] = {{"reference", ref_same}, {"custom", cus_same}};
  (*out)["reproduced"] = reproduced;
  if (!g.json) {
    std::cout << "  recorded custom vs reference  " << StatsLine(rec, Judge(rec, tol))
              << (matches_metadata ? "  (= recorded comparison)" : "  (differs from metadata!)")
              << "\n";
    std::cout << fmt::format(
        "  reproduced {}: re-run equals recorded output: reference {}, custom {}\n",
        reproduced ? "yes" : "NO", ref_same ? "yes" : "no", cus_same ? "yes" : "no");
  }
}

// A golden file: every path against its fp64 answer. False when a path misses it.
bool CompareGolden(const GlobalOptions& g, const ReplayOptions& r, const BundleFile& f,
                   const Tolerance& tol, const Rerun& x, json* out) {
  const int64_t n = f.view.o_elems(), nl = f.view.lse_elems();
  if (!f.o_expected || f.o_expected->data.size() != static_cast<size_t>(n) * 4) return true;
  Tolerance gt = tol;
  gt.max_rel_l2 = r.golden_max_rel_l2;
  gt.max_lse_abs = r.golden_max_lse_abs;
  const float* exp_lse =
      f.lse_expected && f.lse_expected->data.size() == static_cast<size_t>(nl) * 4
          ? f.lse_expected->as<float>()
          : nullptr;
  const float* eo = f.o_expected->as<float>();
  const DiffStats gr =
      CompareBf16ToF32(x.ref.o.data(), eo, n, x.ref.lse.data(), exp_lse, exp_lse ? nl : 0, gt);
  const DiffStats gc =
      CompareBf16ToF32(x.cus.o.data(), eo, n, x.cus.lse.data(), exp_lse, exp_lse ? nl : 0, gt);
  Tolerance ot = gt;  // the oracle is fp32 end to end: far tighter
  ot.max_rel_l2 = 1e-5;
  ot.atol = 1e-5;
  ot.rtol = 1e-5;
  const DiffStats go =
      CompareF32(x.ora.o_f32.data(), eo, n, x.ora.lse.data(), exp_lse, exp_lse ? nl : 0, ot);
  const Verdict vr = Judge(gr, gt), vc = Judge(gc, gt), vo = Judge(go, ot);
  (*out)["golden"] = {{"reference", StatsJson(gr, vr)},
                      {"custom", StatsJson(gc, vc)},
                      {"oracle", StatsJson(go, vo)}};
  if (!g.json) {
    std::cout << "  golden reference              " << StatsLine(gr, vr) << "\n";
    std::cout << "  golden custom                 " << StatsLine(gc, vc) << "\n";
    std::cout << "  golden oracle                 " << StatsLine(go, vo) << "\n";
  }
  return vr.match && vc.match && vo.match;
}

// One file into its entry `out`: false when it did not load, validate or run, or missed its
// golden answer.
bool ReplayFile(const GlobalOptions& g, const ReplayOptions& r, Engine& engine,
                const EngineInfo& info, const std::string& path, json* out) {
  auto f = LoadBundleFile(path);
  if (f.ok()) {
    if (absl::Status st = ValidateBundle(f->view); !st.ok()) f = st;
  }
  if (!f.ok()) {
    FileError(g, path, f.status().message(), out);
    return false;
  }
  const Tolerance tol = ToleranceOf(*f);
  Rerun x;
  if (absl::Status st = RunPaths(engine, f->view, &x); !st.ok()) {
    FileError(g, path, st.message(), out);
    return false;
  }
  CompareRerun(g, path, info, f->view, tol, x, out);
  CompareRecorded(g, *f, tol, x, out);
  return CompareGolden(g, r, *f, tol, x, out);
}

}  // namespace

void AddReplayOptions(CLI::App* app, ReplayOptions* r) {
  app->add_option("files", r->files, ".safetensors bundles")->required();
  app->add_option("--engine", r->engine, "auto, cpu or cuda")->capture_default_str();
  app->add_option("--golden_max_rel_l2", r->golden_max_rel_l2, "bf16 paths vs a golden o_expected")
      ->capture_default_str();
}

int RunReplay(const GlobalOptions& g, const ReplayOptions& r) {
  EngineOptions eo;
  eo.kind = r.engine;
  auto engine = MakeEngine(eo);
  if (!engine.ok()) return Fail(g, "replay", std::string(engine.status().message()));
  const EngineInfo info = (*engine)->Info();
  bool all_ok = true;
  json files = json::array();
  for (const std::string& path : r.files) {
    json out = {{"file", path}, {"engine", info.engine + " " + info.device}};
    if (!ReplayFile(g, r, **engine, info, path, &out)) all_ok = false;
    files.push_back(out);
  }
  if (g.json) PrintJson({{"files", files}, {"ok", all_ok}});
  return all_ok ? 0 : 1;
}

}  // namespace verifyd::cli
