#include "src/probe/invariance.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/bf16.h"
#include "src/common/seconds_since.h"
#include "src/probe/repacked_bundle.h"

namespace verifyd {
namespace {

using kernels::kHeadDimV;

double LseDiff(float a, float b) {
  if (a == b) return 0;  // -inf on both sides too
  if (std::isinf(a) || std::isinf(b)) return INFINITY;
  return std::fabs(double{a} - double{b});
}

// Why `a` breaks the check, or "" when it does not.
std::string Breach(const RowAgreement& a, bool exact, const InvarianceTolerance& tol) {
  if (a.nonfinite > 0) return absl::StrCat(a.nonfinite, " non-finite output elements");
  if (exact && !a.exact()) {
    return absl::StrFormat(
        "%d of %d rows not bit-identical (row rel-L2 up to %.3g at row %d, lse up to %.3g)",
        a.differing_rows, a.rows, a.max_row_rel_l2, a.worst_row, a.max_lse_abs);
  }
  if (!(a.max_row_rel_l2 <= tol.max_row_rel_l2)) {
    return absl::StrFormat("row rel-L2 %.3g > %.3g (row %d)", a.max_row_rel_l2, tol.max_row_rel_l2,
                           a.worst_row);
  }
  if (!(a.max_lse_abs <= tol.max_lse_abs)) {
    return absl::StrFormat("lse differs by %.3g > %.3g", a.max_lse_abs, tol.max_lse_abs);
  }
  return "";
}

// One check: its runs and comparisons, stopping at the first that breaks it.
class Check {
 public:
  Check(const CustomRunner& runner, std::string name, const InvarianceTolerance& tol)
      : runner_(runner), tol_(tol), start_(std::chrono::steady_clock::now()) {
    result_.name = std::move(name);
    result_.passed = true;
  }
  bool ok() const { return result_.passed; }

  // Loads `v` and runs the custom path on it with `splits`; false (the check failed) on error.
  bool Run(const BundleView* v, int splits, PathOutput* out) {
    if (!ok()) return false;
    absl::Status st = v != nullptr ? runner_.load(*v) : absl::OkStatus();
    if (st.ok()) st = runner_.run(splits, out);
    ++result_.runs;
    if (!st.ok()) Fail(absl::StrCat("custom path (splits ", splits, "): ", st.ToString()));
    return ok();
  }
  bool Repack(const BundleView& src, const RepackSpec& spec, std::unique_ptr<RepackedBundle>* out) {
    if (!ok()) return false;
    absl::StatusOr<RepackedBundle> r = RepackedBundle::Make(src, spec);
    if (!r.ok()) {
      Fail(absl::StrCat("repack: ", r.status().ToString()));
      return false;
    }
    *out = std::make_unique<RepackedBundle>(std::move(*r));
    return true;
  }
  // Judges one comparison; `what` says which (for the reason).
  void Judge(const RowAgreement& a, bool exact, const std::string& what) {
    if (!ok()) return;
    result_.agreement.Add(a);
    const std::string why = Breach(a, exact, tol_);
    if (!why.empty()) Fail(absl::StrCat(what, ": ", why));
  }
  InvarianceResult Done() {
    result_.seconds = Since(start_);
    return std::move(result_);
  }

 private:
  void Fail(std::string why) {
    result_.passed = false;
    result_.reason = std::move(why);
  }
  const CustomRunner& runner_;
  const InvarianceTolerance tol_;
  std::chrono::steady_clock::time_point start_;
  InvarianceResult result_;
};

int64_t Prefix(const BundleView& v, int b) { return v.kv_lens[b] - v.shape.draft; }

RowAgreement SameRows(const PathOutput& test, const PathOutput& base, const BundleView& v) {
  return CompareTokenRows(test, base, v.shape.heads, v.rows(), [](int64_t k) { return k; });
}

// Rows of request `b` of a repacked batch against its request's rows run alone.
RowAgreement RequestRows(const PathOutput& test, const PathOutput& alone, const BundleView& v,
                         int b) {
  const int T = v.shape.draft;
  return CompareTokenRows(test, alone, v.shape.heads, v.rows(),
                          [&](int64_t k) { return k / T == b ? k % T : int64_t{-1}; });
}

struct Ctx {
  const CustomRunner& runner;
  const InvarianceCase& c;
  const BundleView& base;
  InvarianceSweep sweep;
  const InvarianceTolerance& tol;
  PathOutput planned;  // the base bundle under the path's own plan
  std::string Name(const char* check) const {
    return absl::StrCat("invariance/", c.name, "/", check);
  }
  bool full() const { return sweep == InvarianceSweep::kFull; }
};

InvarianceResult SplitPlan(Ctx& x) {
  Check k(x.runner, x.Name("split_plan"), x.tol);
  const int64_t max_tiles = (x.base.max_kv_len + x.runner.tile_tokens - 1) / x.runner.tile_tokens;
  PathOutput one, out;
  if (k.Run(&x.base, 1, &one)) {
    for (int s : InvarianceSplitCounts(max_tiles, x.sweep)) {
      if (s == 1) continue;
      if (!k.Run(nullptr, s, &out)) break;
      k.Judge(SameRows(out, one, x.base), false, absl::StrCat(s, " splits against 1"));
    }
  }
  return k.Done();
}

InvarianceResult PageSize(Ctx& x) {
  Check k(x.runner, x.Name("page_size"), x.tol);
  const std::vector<int> pages = x.full() ? std::vector<int>{1, 16, 64}
                                          : std::vector<int>{x.base.shape.page_size == 1 ? 64 : 1};
  std::unique_ptr<RepackedBundle> r;
  PathOutput out;
  for (int page : pages) {
    if (page == x.base.shape.page_size) continue;
    RepackSpec spec;
    spec.page_size = page;
    spec.page_shuffle = 0x9a6e + static_cast<uint64_t>(page);
    if (!k.Repack(x.base, spec, &r) || !k.Run(&r->view(), 0, &out)) break;
    k.Judge(SameRows(out, x.planned, x.base), true, absl::StrCat("page size ", page));
  }
  return k.Done();
}

InvarianceResult PageOrder(Ctx& x) {
  Check k(x.runner, x.Name("page_order"), x.tol);
  std::unique_ptr<RepackedBundle> r;
  PathOutput out;
  for (uint64_t seed : {uint64_t{0x0e4d}, uint64_t{0x0e4e}}) {
    RepackSpec spec;
    spec.page_shuffle = seed;
    if (!k.Repack(x.base, spec, &r) || !k.Run(&r->view(), 0, &out)) break;
    k.Judge(SameRows(out, x.planned, x.base), true,
            absl::StrFormat("pages permuted (seed %#x)", seed));
    if (!x.full()) break;
  }
  return k.Done();
}

// Each request alone under the path's own plan; the batch and padding checks compare with these.
bool RunAlone(Ctx& x, Check& k, std::vector<PathOutput>* alone) {
  const int B = x.base.shape.batch;
  std::vector<PathOutput> got(B);
  std::unique_ptr<RepackedBundle> r;
  for (int b = 0; b < B; ++b) {
    RepackSpec spec;
    spec.requests = {b};
    if (!k.Repack(x.base, spec, &r) || !k.Run(&r->view(), 0, &got[b])) return false;
  }
  *alone = std::move(got);
  return true;
}

// The batch in `order` (source requests), each request's rows against it alone.
void JudgeArrangement(Ctx& x, Check& k, const std::vector<PathOutput>& alone,
                      const std::vector<int>& order, const char* what) {
  std::unique_ptr<RepackedBundle> r;
  PathOutput out;
  RepackSpec spec;
  spec.requests = order;
  if (!k.Repack(x.base, spec, &r) || !k.Run(&r->view(), 0, &out)) return;
  for (int b = 0; b < static_cast<int>(order.size()); ++b) {
    k.Judge(RequestRows(out, alone[order[b]], r->view(), b), false,
            absl::StrCat("request ", order[b], " at position ", b, " of ", order.size(), " (", what,
                         ") against alone"));
  }
}

InvarianceResult Batch(Ctx& x, std::vector<PathOutput>* alone) {
  Check k(x.runner, x.Name("batch"), x.tol);
  const int B = x.base.shape.batch;
  if (RunAlone(x, k, alone)) {
    for (int b = 0; b < B; ++b) {
      k.Judge(RequestRows(x.planned, (*alone)[b], x.base, b), false,
              absl::StrCat("request ", b, " in the batch against alone"));
    }
    if (x.full()) {
      for (int rot = 1; rot < B; ++rot) {
        std::vector<int> order(B);
        for (int b = 0; b < B; ++b) order[b] = (b + rot) % B;
        JudgeArrangement(x, k, *alone, order, "rotated");
      }
      std::vector<int> reversed(B);
      for (int b = 0; b < B; ++b) reversed[b] = B - 1 - b;
      JudgeArrangement(x, k, *alone, reversed, "reversed");
    }
  }
  return k.Done();
}

InvarianceResult Padding(Ctx& x, const std::vector<PathOutput>& alone) {
  Check k(x.runner, x.Name("padding"), x.tol);
  std::vector<int> pads, targets;
  for (int b = 0; b < x.base.shape.batch; ++b) {
    (Prefix(x.base, b) < x.runner.tile_tokens ? pads : targets).push_back(b);
  }
  if (pads.empty()) return k.Done();
  for (int t : targets) {
    std::vector<int> before = pads, after = {t};
    before.push_back(t);
    after.insert(after.end(), pads.begin(), pads.end());
    JudgeArrangement(x, k, alone, before, "after the padding");
    JudgeArrangement(x, k, alone, after, "before the padding");
    if (!x.full()) break;
  }
  return k.Done();
}

// Shifts that move a request's draft block start into the next tile, 1 and T/2.
std::vector<int> Shifts(const Ctx& x) {
  const int T = x.base.shape.draft, tile = x.runner.tile_tokens;
  std::set<int> s = {1};
  if (x.full()) {
    s.insert(T / 2);
    for (int b = 0; b < x.base.shape.batch; ++b) {
      const int into_tile = static_cast<int>(Prefix(x.base, b) % tile);
      s.insert(tile - into_tile);
    }
  }
  std::vector<int> v;
  for (int d : s) {
    if (d >= 1 && d < T) v.push_back(d);
  }
  return v;
}

InvarianceResult DraftShift(Ctx& x) {
  Check k(x.runner, x.Name("draft_shift"), x.tol);
  std::unique_ptr<RepackedBundle> r;
  PathOutput out;
  const int T = x.base.shape.draft;
  for (int s : Shifts(x)) {
    RepackSpec spec;
    spec.draft_shift = s;
    if (!k.Repack(x.base, spec, &r) || !k.Run(&r->view(), 0, &out)) break;
    const int Tn = r->view().shape.draft;
    const RepackedBundle& rb = *r;
    k.Judge(CompareTokenRows(out, x.planned, x.base.shape.heads, r->view().rows(),
                             [&](int64_t kr) {
                               const int b = static_cast<int>(kr / Tn),
                                         i = static_cast<int>(kr % Tn);
                               return rb.Comparable(b, i) ? int64_t{b} * T + rb.SourceToken(i)
                                                          : int64_t{-1};
                             }),
            false, absl::StrCat("draft block ", s, " tokens later"));
  }
  return k.Done();
}

}  // namespace

void RowAgreement::Add(const RowAgreement& o) {
  rows += o.rows;
  differing_rows += o.differing_rows;
  nonfinite += o.nonfinite;
  max_lse_abs = std::max(max_lse_abs, o.max_lse_abs);
  if (o.max_row_rel_l2 > max_row_rel_l2 || worst_row < 0) {
    max_row_rel_l2 = std::max(max_row_rel_l2, o.max_row_rel_l2);
    worst_row = o.worst_row;
  }
}

RowAgreement CompareTokenRows(const PathOutput& test, const PathOutput& base, int heads,
                              int64_t token_rows, const std::function<int64_t(int64_t)>& base_row) {
  RowAgreement a;
  const bool lse = !test.lse.empty() && !base.lse.empty();
  for (int64_t k = 0; k < token_rows; ++k) {
    const int64_t bk = base_row(k);
    if (bk < 0) continue;
    for (int h = 0; h < heads; ++h) {
      const int64_t tr = k * heads + h, br = bk * heads + h;
      if ((tr + 1) * kHeadDimV > static_cast<int64_t>(test.o.size()) ||
          (br + 1) * kHeadDimV > static_cast<int64_t>(base.o.size())) {
        ++a.nonfinite;  // a row the output does not hold: never passes
        continue;
      }
      const uint16_t* t = test.o.data() + tr * kHeadDimV;
      const uint16_t* b = base.o.data() + br * kHeadDimV;
      ++a.rows;
      bool same = std::memcmp(t, b, kHeadDimV * 2) == 0;
      double diff = 0, norm = 0;
      for (int d = 0; d < kHeadDimV; ++d) {
        const double tv = Bf16ToFloat(t[d]), bv = Bf16ToFloat(b[d]);
        if (!std::isfinite(tv)) ++a.nonfinite;
        diff += (tv - bv) * (tv - bv);
        norm += bv * bv;
      }
      const double rel = diff == 0 ? 0 : norm == 0 ? INFINITY : std::sqrt(diff / norm);
      if (rel > a.max_row_rel_l2 || a.worst_row < 0) {
        a.max_row_rel_l2 = std::max(a.max_row_rel_l2, rel);
        a.worst_row = tr;
      }
      if (lse) {
        const float tl = test.lse[tr], bl = base.lse[br];
        if (std::isnan(tl) || tl == INFINITY) ++a.nonfinite;
        a.max_lse_abs = std::max(a.max_lse_abs, LseDiff(tl, bl));
        same = same && std::memcmp(&tl, &bl, sizeof(float)) == 0;
      }
      a.differing_rows += !same;
    }
  }
  return a;
}

CustomRunner EngineCustomRunner(Engine& engine) {
  auto prepared = std::make_shared<std::shared_ptr<PreparedBundle>>();
  CustomRunner r;
  r.tile_tokens = std::max(1, engine.Info().custom_tile_tokens);
  r.load = [&engine, prepared](const BundleView& v) -> absl::Status {
    prepared->reset();
    absl::StatusOr<std::shared_ptr<PreparedBundle>> pb = engine.Prepare(v, /*detach=*/false);
    if (!pb.ok()) return pb.status();
    *prepared = *std::move(pb);
    return absl::OkStatus();
  };
  r.run = [&engine, prepared](int splits, PathOutput* out) -> absl::Status {
    if (*prepared == nullptr) return absl::FailedPreconditionError("no bundle loaded");
    if (absl::Status st = engine.RunCustomSplits(**prepared, splits); !st.ok()) return st;
    return engine.Fetch(Path::kCustom, **prepared, out);
  };
  return r;
}

std::vector<int> InvarianceSplitCounts(int64_t max_tiles, InvarianceSweep sweep) {
  std::vector<int> v = {0, 1};
  const int n = static_cast<int>(std::max<int64_t>(1, max_tiles));
  auto tps = [&](int s) { return (n + s - 1) / s; };
  if (sweep == InvarianceSweep::kFull) {
    for (int s = 2; s <= n; ++s) {
      if (tps(s) != tps(s - 1)) v.push_back(s);
    }
    return v;
  }
  std::set<int> s;
  for (int c : {2, 3, n}) {
    if (c <= n) s.insert(c);
  }
  bool even = false, odd = false;
  for (int c = 2; c <= n && !(even && odd); ++c) {
    const int t = tps(c);
    if (t > 1 && t % 2 == 0 && !even) s.insert(c), even = true;
    if (t > 1 && t % 2 == 1 && !odd) s.insert(c), odd = true;
  }
  for (int c : s) {
    if (c > 1) v.push_back(c);
  }
  return v;
}

std::vector<InvarianceCase> InvarianceCases(int64_t max_prefix, int tile_tokens) {
  const int64_t tile = std::max(1, tile_tokens);
  // A prefix that puts a draft block of more than 3 tokens across a tile boundary near `near`.
  auto straddle = [&](int64_t near) { return std::max<int64_t>(near / tile * tile - 3, 0); };
  const bool large = max_prefix >= 16384;
  std::vector<InvarianceCase> v(2);
  InvarianceCase& ragged = v[0];
  ragged.name = "ragged";
  ragged.spec.tree = TreeKind::kRandomTree;
  ragged.spec.traffic = Traffic::kRandom;
  ragged.spec.page_size = 64;
  ragged.spec.seed = 0x1a6ed;
  if (large) {
    ragged.spec.draft = 16;
    ragged.spec.heads = 16;
    ragged.spec.prefix_lens = {500, 1000, straddle(2048), 4033, 16065, 0, 37};
  } else {  // the CPU engine's: prefixes up to max_prefix (at most 1024)
    const int64_t p = std::clamp<int64_t>(max_prefix, 256, 1024);
    ragged.spec.draft = 8;
    ragged.spec.heads = 4;
    ragged.spec.prefix_lens = {p / 2 - 12, straddle(p), 0, 37, p * 11 / 16};
  }
  ragged.spec.batch = static_cast<int>(ragged.spec.prefix_lens.size());
  // T * H not a multiple of the 64-row block: the last row block of each request is partial.
  InvarianceCase& chain = v[1];
  chain.name = "chain";
  chain.spec.tree = TreeKind::kChain;
  chain.spec.traffic = Traffic::kRealistic;
  chain.spec.page_size = 16;
  chain.spec.mask_format = kernels::MaskFormat::kBits;
  chain.spec.draft = 5;
  chain.spec.seed = 0xc4a1;
  if (large) {
    chain.spec.heads = 24;
    chain.spec.prefix_lens = {straddle(4096), 130, straddle(8192), 1};
  } else {
    chain.spec.heads = 4;
    chain.spec.prefix_lens = {straddle(std::clamp<int64_t>(max_prefix, 256, 1024)), 130, 1};
  }
  chain.spec.batch = static_cast<int>(chain.spec.prefix_lens.size());
  return v;
}

std::vector<InvarianceResult> RunInvarianceChecks(const CustomRunner& runner,
                                                  const InvarianceCase& c, InvarianceSweep sweep,
                                                  const InvarianceTolerance& tol) {
  RandomBundle bundle(c.spec);
  Ctx x{runner, c, bundle.view(), sweep, tol, {}};
  std::vector<InvarianceResult> out;
  {
    Check k(runner, x.Name("plan"), tol);
    if (!k.Run(&x.base, 0, &x.planned)) {
      out.push_back(k.Done());
      return out;
    }
  }
  out.push_back(SplitPlan(x));
  out.push_back(PageSize(x));
  out.push_back(PageOrder(x));
  std::vector<PathOutput> alone;
  out.push_back(Batch(x, &alone));
  if (!alone.empty()) out.push_back(Padding(x, alone));  // needs the requests run alone
  out.push_back(DraftShift(x));
  return out;
}

}  // namespace verifyd
