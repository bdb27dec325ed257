#include "src/probe/probe_suite.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "src/common/bf16.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;

// Draft tokens token i of request b sees, itself first, then its ancestors nearest first.
std::vector<int> Visible(const BundleView& v, int b, int i) {
  std::vector<int> out{i};
  for (int j = i - 1; j >= 0; --j) {
    if (v.MaskBit(b, i, j)) out.push_back(j);
  }
  return out;
}

// Makes key t dominate query row (b, i, h): q = K[t] * L / (sm_scale * |K[t]|^2).
void Dominate(RandomBundle& rb, int b, int i, int h, int64_t t) {
  const BundleView& v = rb.view();
  const uint16_t* k = v.KvRow(b, t);
  double norm2 = 0;
  for (int d = 0; d < kHeadDimQK; ++d) norm2 += double{Bf16ToFloat(k[d])} * Bf16ToFloat(k[d]);
  const double logit = std::log(static_cast<double>(v.kv_lens[b])) + 10;
  const double scale = logit / (v.sm_scale * std::max(norm2, 1e-6));
  uint16_t* q = rb.q.data() + ((int64_t{b} * v.shape.draft + i) * v.shape.heads + h) * kHeadDimQK;
  for (int d = 0; d < kHeadDimQK; ++d) {
    q[d] = FloatToBf16(static_cast<float>(Bf16ToFloat(k[d]) * scale));
  }
}

RandomBundleSpec Spec(int draft, int heads, int64_t prefix, int page, TreeKind tree,
                      uint64_t seed) {
  RandomBundleSpec s;
  s.batch = 1;
  s.draft = draft;
  s.heads = heads;
  s.prefix = prefix;
  s.page_size = page;
  s.tree = tree;
  s.seed = seed;
  return s;
}

// Assigns prefix targets to the rows of request 0 round-robin (every target at least once when
// there are enough rows), draft token by draft token, head by head.
void DominatePrefixTargets(RandomBundle& rb, const std::vector<int64_t>& targets) {
  const BundleView& v = rb.view();
  if (targets.empty()) return;
  size_t next = 0;
  for (int i = 0; i < v.shape.draft; ++i) {
    for (int h = 0; h < v.shape.heads; ++h) {
      Dominate(rb, 0, i, h, targets[next++ % targets.size()]);
    }
  }
}

// At most `n` of `all` (sorted), evenly spaced, always keeping the first and the last.
std::vector<int64_t> Spread(const std::vector<int64_t>& all, size_t n) {
  if (all.size() <= n || n < 2) return all;
  std::vector<int64_t> out;
  for (size_t k = 0; k < n; ++k) out.push_back(all[k * (all.size() - 1) / (n - 1)]);
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

ProbeBundle Make(std::string name, std::string feature, const RandomBundleSpec& spec) {
  return {std::move(name), std::move(feature), std::make_unique<RandomBundle>(spec)};
}

void AddDraftPositions(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  for (TreeKind tree : {TreeKind::kChain, TreeKind::kRandomTree}) {
    const bool chain = tree == TreeKind::kChain;
    ProbeBundle p = Make(absl::StrCat("draft_positions/", chain ? "chain" : "tree"),
                         "each draft token's own key, then its ancestors' (tail-heavy)",
                         Spec(16, 16, std::min<int64_t>(o.max_prefix, 300), 16, tree, o.seed + 1));
    const BundleView& v = p.bundle->view();
    const int64_t prefix = v.kv_lens[0] - v.shape.draft;
    for (int i = 0; i < v.shape.draft; ++i) {
      const std::vector<int> seen = Visible(v, 0, i);
      for (int h = 0; h < v.shape.heads; ++h) {
        Dominate(*p.bundle, 0, i, h, prefix + seen[h % seen.size()]);
      }
    }
    out->push_back(std::move(p));
  }
}

void AddPageEdges(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  for (int page : {1, 64}) {
    ProbeBundle p = Make(absl::StrCat("page_edges/page", page),
                         "the first and last token of every page, pages scattered",
                         Spec(16, 16, std::min<int64_t>(o.max_prefix, 1021), page,
                              TreeKind::kRandomTree, o.seed + 2 + page));
    const BundleView& v = p.bundle->view();
    const int64_t prefix = v.kv_lens[0] - v.shape.draft;
    std::set<int64_t> edges;
    for (int64_t first = 0; first < prefix; first += page) {
      edges.insert(first);
      edges.insert(std::min(prefix, first + page) - 1);
    }
    const std::vector<int64_t> all(edges.begin(), edges.end());
    DominatePrefixTargets(*p.bundle, Spread(all, v.shape.draft * v.shape.heads));
    out->push_back(std::move(p));
  }
}

void AddSplitBoundaries(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  const int64_t prefix = std::max<int64_t>(o.max_prefix, 1);
  // Both sides of every 64-token boundary, and the last split (the last eighth of the prefix,
  // spread over 64 tokens and its very last one).
  std::set<int64_t> t;
  for (int64_t k = 64; k < prefix; k += 64) {
    t.insert(k - 1);
    t.insert(k);
  }
  const int64_t last_split = prefix - std::max<int64_t>(1, prefix / 8);
  for (int64_t k = 0; k < 64; ++k) t.insert(last_split + k * (prefix - last_split) / 64);
  t.insert(prefix - 1);
  std::vector<int64_t> all;
  for (int64_t x : t) {
    if (x >= 0 && x < prefix) all.push_back(x);
  }
  const int draft = 4;
  const int heads = static_cast<int>(std::clamp<int64_t>(
      (static_cast<int64_t>(all.size()) + draft - 1) / draft, 8, kernels::kMaxHeads));
  ProbeBundle p = Make("split_boundaries",
                       "both sides of every 64-token tile/split boundary and the last split",
                       Spec(draft, heads, prefix, 16, TreeKind::kRandomTree, o.seed + 3));
  DominatePrefixTargets(*p.bundle, Spread(all, draft * heads));
  out->push_back(std::move(p));
}

void AddPrefixSweep(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  std::set<int64_t> prefixes{0, 1, o.max_prefix};
  for (int64_t p = 64; p <= o.max_prefix; p *= 2) {
    prefixes.insert(p - 1);
    if (p + 1 <= o.max_prefix) prefixes.insert(p + 1);
  }
  for (int64_t prefix : prefixes) {
    ProbeBundle p = Make(absl::StrCat("prefix/", prefix),
                         "the first, middle and last prefix token and the row's own draft token",
                         Spec(4, 16, prefix, 16, TreeKind::kRandomTree, o.seed + 100 + prefix));
    const BundleView& v = p.bundle->view();
    for (int i = 0; i < v.shape.draft; ++i) {
      for (int h = 0; h < v.shape.heads; ++h) {
        int64_t t = prefix + i;  // the row's own draft token
        if (prefix > 0 && h % 4 == 0) t = prefix - 1;
        if (prefix > 0 && h % 4 == 1) t = 0;
        if (prefix > 0 && h % 4 == 2) t = prefix / 2;
        Dominate(*p.bundle, 0, i, h, t);
      }
    }
    out->push_back(std::move(p));
  }
}

void AddUndominated(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  RandomBundleSpec masked = Spec(8, 16, 100, 16, TreeKind::kRandomTree, o.seed + 4);
  masked.batch = 2;
  masked.empty_row = true;  // request 0: prefix 0, draft row 4 sees nothing
  masked.traffic = Traffic::kRealistic;
  out->push_back(
      Make("fully_masked_rows", "a draft row that sees no key: output 0, lse -inf", masked));
  for (TreeKind tree : {TreeKind::kChain, TreeKind::kRandomTree}) {
    RandomBundleSpec s = Spec(16, 16, std::min<int64_t>(o.max_prefix, 4096), 64, tree, o.seed + 5);
    s.traffic = Traffic::kRealistic;
    out->push_back(Make(absl::StrCat("sink_recency/", tree == TreeKind::kChain ? "chain" : "tree"),
                        "sink, recent and heavy-hitter tokens, like a served model", s));
  }
  // Every other probe runs at 1/sqrt(192), where a path that ignores the bundle's scale for that
  // constant is exact.
  RandomBundleSpec scaled =
      Spec(8, 16, std::min<int64_t>(o.max_prefix, 1000), 64, TreeKind::kRandomTree, o.seed + 6);
  scaled.batch = 2;
  scaled.traffic = Traffic::kRealistic;
  scaled.sm_scale = kDeepSeekV3SmScale;
  out->push_back(Make("sm_scale/deepseek_v3",
                      "DeepSeek-V3's softmax scale with its YaRN factor (0.1352, not 1/sqrt(192))",
                      scaled));
}

// An e4m3 pool at a scale that is neither 1 nor a power of two: two requests of uneven prefixes
// (the last page of each partly used, its other slots NaN), pages of 16 scattered over the pool.
// Realistic traffic, where the logits' scale decides the weights; the scale puts about 15% of the
// codes among the subnormals, so a decode that gets them wrong moves the rows too.
void AddE4m3Pool(const ProbeSuiteOptions& o, std::vector<ProbeBundle>* out) {
  RandomBundleSpec s = Spec(8, 8, 0, 16, TreeKind::kRandomTree, o.seed + 7);
  s.batch = 2;
  s.prefix_lens = {std::min<int64_t>(o.max_prefix, 500), std::min<int64_t>(o.max_prefix, 131)};
  s.traffic = Traffic::kRealistic;
  s.kv_dtype = kernels::KvDtype::kE4m3;
  s.kv_scale = kE4m3ProbeKvScale;
  ProbeBundle p =
      Make(absl::StrCat("kv_e4m3/scale_", kE4m3ProbeKvScale),
           absl::StrCat("an e4m3 pool at kv_scale ", kE4m3ProbeKvScale,
                        " (subnormal codes included), each path against the oracle too"),
           s);
  p.against_oracle = true;
  out->push_back(std::move(p));
}

}  // namespace

int64_t DefaultProbeMaxPrefix(const std::string& engine) {
  return engine == "cuda" ? kernels::kMaxPrefix : 2048;
}

absl::Status ValidateProbeSuiteOptions(const ProbeSuiteOptions& o) {
  if (o.max_prefix < 64 || o.max_prefix > kernels::kMaxPrefix) {
    return absl::InvalidArgumentError(absl::StrCat("probe_max_prefix: ", o.max_prefix,
                                                   " is not in [64, ", kernels::kMaxPrefix, "]"));
  }
  return absl::OkStatus();
}

std::vector<ProbeBundle> BuildProbeSuite(const ProbeSuiteOptions& o) {
  std::vector<ProbeBundle> out;
  AddDraftPositions(o, &out);
  AddPageEdges(o, &out);
  AddSplitBoundaries(o, &out);
  AddPrefixSweep(o, &out);
  AddUndominated(o, &out);
  AddE4m3Pool(o, &out);
  return out;
}

}  // namespace verifyd
