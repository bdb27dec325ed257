#include "src/bundle/random_bundle.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "kernels/e4m3.h"
#include "src/common/bf16.h"

namespace verifyd {
namespace {

constexpr uint16_t kBf16Nan = 0x7fc0;

// parent[i] for token i of one request's draft tail; parent[0] = -1 (the root).
std::vector<int> MakeParents(TreeKind kind, int draft, std::mt19937_64& rng) {
  std::vector<int> parent(draft, -1);
  for (int i = 1; i < draft; ++i) {
    if (kind == TreeKind::kChain) {
      parent[i] = i - 1;
    } else {
      parent[i] = std::uniform_int_distribution<int>(0, i - 1)(rng);
    }
  }
  return parent;
}

void SetMaskBit(kernels::MaskFormat f, uint8_t* row, int j) {
  if (f == kernels::MaskFormat::kBytes) {
    row[j] = 1;
  } else {
    row[j >> 3] |= static_cast<uint8_t>(1u << (j & 7));
  }
}

// A key a realistic query attends to and the logit (natural-log units) it should get.
struct Target {
  int64_t token;
  double logit;
};

// The keys draft token i of request b attends to in head h: sinks, recent prefix tokens, the
// head's heavy hitters, itself and its nearest ancestors. Logits are relative to log(kv_len) so
// that the chosen keys keep most of the weight at any prefix length.
std::vector<Target> RealisticTargets(int64_t prefix, int64_t kv_len, int i,
                                     const std::vector<int>& parent,
                                     const std::vector<int64_t>& heavy) {
  const double base = std::log(static_cast<double>(kv_len));
  std::vector<Target> t;
  for (int64_t s = 0; s < std::min<int64_t>(2, prefix); ++s) t.push_back({s, base + 3});
  for (int64_t d = 1; d <= std::min<int64_t>(8, prefix); ++d) {
    t.push_back({prefix - d, base + 2 - 0.25 * static_cast<double>(d - 1)});
  }
  for (int64_t pos : heavy) t.push_back({pos, base + 2.5});
  t.push_back({prefix + i, base + 4});
  int depth = 0;
  for (int j = parent[i]; j >= 0 && depth < 3; j = parent[j], ++depth) {
    t.push_back({prefix + j, base + (depth == 0 ? 3 : 1.5)});
  }
  return t;
}

// q of every (draft token, head): sum over targets of u * K_target, u chosen so that
// sm_scale * q . K_target ~ its logit (cross terms add noise of a few nats, as real heads have).
void FillRealisticQueries(const BundleView& v, const std::vector<std::vector<int>>& parents,
                          uint64_t seed, uint16_t* q) {
  using kernels::kHeadDimQK;
  const int B = v.shape.batch, T = v.shape.draft, H = v.shape.heads;
  std::mt19937_64 rng(seed ^ 0x7ea1157c7a77e11full);
  std::uniform_real_distribution<double> jitter(-1.0, 1.0);
  std::vector<double> acc(kHeadDimQK);
  for (int b = 0; b < B; ++b) {
    const int64_t kv_len = v.kv_lens[b], prefix = kv_len - T;
    for (int h = 0; h < H; ++h) {
      std::vector<int64_t> heavy;
      for (int k = 0; k < 3 && prefix > 0; ++k) {
        heavy.push_back(std::uniform_int_distribution<int64_t>(0, prefix - 1)(rng));
      }
      for (int i = 0; i < T; ++i) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (const Target& t : RealisticTargets(prefix, kv_len, i, parents[b], heavy)) {
          const uint16_t* key = v.KvRow(b, t.token);
          double k2 = 0;
          for (int d = 0; d < kHeadDimQK; ++d) {
            k2 += double{Bf16ToFloat(key[d])} * Bf16ToFloat(key[d]);
          }
          const double u = (t.logit + jitter(rng)) / (double{v.sm_scale} * k2);
          for (int d = 0; d < kHeadDimQK; ++d) acc[d] += u * Bf16ToFloat(key[d]);
        }
        uint16_t* dst = q + ((int64_t{b} * T + i) * H + h) * kHeadDimQK;
        for (int d = 0; d < kHeadDimQK; ++d) dst[d] = FloatToBf16(static_cast<float>(acc[d]));
      }
    }
  }
}

}  // namespace

bool ParseTraffic(const std::string& name, Traffic* out) {
  if (name == "random") {
    *out = Traffic::kRandom;
  } else if (name == "realistic") {
    *out = Traffic::kRealistic;
  } else {
    return false;
  }
  return true;
}

const char* TrafficName(Traffic t) { return t == Traffic::kRealistic ? "realistic" : "random"; }

RandomBundle::RandomBundle(const RandomBundleSpec& spec) : spec_(spec) {
  using kernels::kHeadDimQK;
  const int B = spec.batch, T = spec.draft, H = spec.heads, P = spec.page_size;
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.f, 1.f);

  kv_lens.resize(B);
  for (int b = 0; b < B; ++b) {
    int64_t prefix = spec.prefix_lens.empty() ? spec.prefix : spec.prefix_lens[b];
    if (spec.empty_row && b == 0) prefix = 0;
    kv_lens[b] = static_cast<int32_t>(prefix + T);
  }

  kv_indptr.assign(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    kv_indptr[b + 1] = kv_indptr[b] + (kv_lens[b] + P - 1) / P;
  }
  const int64_t used_pages = kv_indptr[B];
  const int64_t num_pages = std::max<int64_t>(1, used_pages + std::max(0, spec.extra_pages));

  kv_pool.resize(num_pages * P * kHeadDimQK);
  for (auto& x : kv_pool) x = FloatToBf16(normal(rng));

  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  kv_indices.assign(perm.begin(), perm.begin() + used_pages);

  // Poison every slot outside the requests' tokens: a path that reads it outputs NaN.
  std::vector<bool> used(num_pages * P, false);
  for (int b = 0; b < B; ++b) {
    for (int64_t t = 0; t < kv_lens[b]; ++t) {
      used[int64_t{kv_indices[kv_indptr[b] + t / P]} * P + t % P] = true;
    }
  }
  for (int64_t slot = 0; slot < num_pages * P; ++slot) {
    if (!used[slot]) {
      std::fill_n(kv_pool.begin() + slot * kHeadDimQK, kHeadDimQK, kBf16Nan);
    }
  }

  q.resize(int64_t{B} * T * H * kHeadDimQK);
  if (spec.traffic == Traffic::kRandom) {
    for (auto& x : q) x = FloatToBf16(normal(rng) * spec.q_scale);
  }

  const int64_t row_bytes = kernels::MaskRowBytes(spec.mask_format, T);
  tree_mask.assign(int64_t{B} * T * row_bytes, 0);
  std::vector<std::vector<int>> parents(B);
  for (int b = 0; b < B; ++b) {
    parents[b] = MakeParents(spec.tree, T, rng);
    const std::vector<int>& parent = parents[b];
    for (int i = 0; i < T; ++i) {
      uint8_t* row = tree_mask.data() + (int64_t{b} * T + i) * row_bytes;
      for (int j = i; j >= 0; j = parent[j]) SetMaskBit(spec.mask_format, row, j);
    }
  }
  if (spec.empty_row) {
    uint8_t* row = tree_mask.data() + int64_t{T / 2} * row_bytes;
    std::fill_n(row, row_bytes, 0);
  }

  view_.shape.batch = B;
  view_.shape.draft = T;
  view_.shape.heads = H;
  view_.shape.page_size = P;
  view_.shape.num_pages = num_pages;
  view_.shape.num_indices = used_pages;
  view_.shape.mask_format = spec.mask_format;
  view_.q = q.data();
  view_.kv_pool = kv_pool.data();
  view_.kv_indptr = kv_indptr.data();
  view_.kv_indices = kv_indices.data();
  view_.kv_lens = kv_lens.data();
  view_.tree_mask = tree_mask.data();
  view_.sm_scale = spec.sm_scale;
  view_.max_kv_len = *std::max_element(kv_lens.begin(), kv_lens.end());
  view_.total_kv_len = std::accumulate(kv_lens.begin(), kv_lens.end(), int64_t{0});
  if (spec.traffic == Traffic::kRealistic) {
    FillRealisticQueries(view_, parents, spec.seed, q.data());
  }
  if (spec.kv_dtype == kernels::KvDtype::kE4m3) {
    kv_pool_e4m3.resize(kv_pool.size());
    for (size_t i = 0; i < kv_pool.size(); ++i) {
      kv_pool_e4m3[i] = kernels::FloatToE4m3(Bf16ToFloat(kv_pool[i]) / spec.kv_scale);
    }
    view_.kv_pool = kv_pool_e4m3.data();
    view_.shape.kv_dtype = kernels::KvDtype::kE4m3;
    view_.kv_scale = spec.kv_scale;
  }
}

}  // namespace verifyd
