// Random bundles: NaN poisoning of unused pool slots, masks that are trees, determinism.

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;

RandomBundleSpec Spec(uint64_t seed) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 17;
  s.heads = 2;
  s.page_size = 16;
  s.prefix_lens = {5, 97, 0};
  s.seed = seed;
  return s;
}

TEST(RandomBundle, SizesAndKvLengths) {
  RandomBundle rb(Spec(1));
  const BundleView& v = rb.view();
  EXPECT_EQ(v.kv_lens[0], 22);
  EXPECT_EQ(v.kv_lens[1], 114);
  EXPECT_EQ(v.kv_lens[2], 17);
  EXPECT_EQ(v.max_kv_len, 114);
  EXPECT_EQ(v.total_kv_len, 22 + 114 + 17);
  EXPECT_EQ(v.kv_indptr[3], 2 + 8 + 2);
  EXPECT_EQ(v.shape.num_indices, 12);
  EXPECT_EQ(v.shape.num_pages, 12 + 3);
  EXPECT_EQ(static_cast<int64_t>(rb.q.size()), v.q_elems());
  EXPECT_EQ(static_cast<int64_t>(rb.kv_pool.size()), v.kv_elems());
  EXPECT_EQ(static_cast<int64_t>(rb.tree_mask.size()), v.mask_bytes());
}

TEST(RandomBundle, PassesValidation) {
  for (auto fmt : {kernels::MaskFormat::kBytes, kernels::MaskFormat::kBits}) {
    RandomBundleSpec s = Spec(10);
    s.mask_format = fmt;
    s.empty_row = true;
    RandomBundle rb(s);
    BundleView v = rb.view();
    v.max_kv_len = v.total_kv_len = 0;
    ASSERT_TRUE(ValidateBundle(v).ok()) << ValidateBundle(v);
    EXPECT_EQ(v.max_kv_len, rb.view().max_kv_len);
    EXPECT_EQ(v.total_kv_len, rb.view().total_kv_len);
  }
}

TEST(RandomBundle, UnusedSlotsAreNanUsedOnesFinite) {
  for (int page : {1, 16, 64}) {
    RandomBundleSpec s = Spec(2);
    s.page_size = page;
    RandomBundle rb(s);
    const BundleView& v = rb.view();
    std::set<int64_t> used;
    std::set<int32_t> pages;
    for (int b = 0; b < v.shape.batch; ++b) {
      for (int64_t t = 0; t < v.kv_lens[b]; ++t) {
        const uint16_t* row = v.KvRow(b, t);
        used.insert((row - rb.kv_pool.data()) / kHeadDimQK);
        for (int d = 0; d < kHeadDimQK; ++d) ASSERT_TRUE(std::isfinite(Bf16ToFloat(row[d])));
      }
    }
    for (int64_t k = 0; k < v.shape.num_indices; ++k) pages.insert(v.kv_indices[k]);
    EXPECT_EQ(static_cast<int64_t>(pages.size()), v.shape.num_indices) << "pages are distinct";
    const int64_t slots = v.shape.num_pages * page;
    for (int64_t slot = 0; slot < slots; ++slot) {
      if (used.count(slot)) continue;
      for (int d = 0; d < kHeadDimQK; ++d) {
        ASSERT_EQ(rb.kv_pool[slot * kHeadDimQK + d], 0x7fc0) << "slot " << slot;
      }
    }
  }
}

TEST(RandomBundle, PagesAreShuffled) {
  RandomBundleSpec s = Spec(3);
  s.page_size = 1;
  RandomBundle rb(s);
  bool in_order = true;
  for (int64_t k = 0; k < rb.view().shape.num_indices; ++k) in_order &= rb.kv_indices[k] == k;
  EXPECT_FALSE(in_order);
}

// mask[i][i] = 1, the row of i is {i} + the row of its parent (the largest j < i it sees).
void ExpectTree(const BundleView& v, int b, bool chain) {
  const int T = v.shape.draft;
  for (int i = 0; i < T; ++i) {
    ASSERT_TRUE(v.MaskBit(b, i, i));
    for (int j = i + 1; j < T; ++j) ASSERT_FALSE(v.MaskBit(b, i, j)) << i << " sees later " << j;
    if (i == 0) continue;
    int parent = -1;
    for (int j = i - 1; j >= 0 && parent < 0; --j) {
      if (v.MaskBit(b, i, j)) parent = j;
    }
    ASSERT_GE(parent, 0) << "token " << i << " has no parent";
    if (chain) {
      ASSERT_EQ(parent, i - 1);
    }
    for (int j = 0; j < i; ++j) {
      ASSERT_EQ(v.MaskBit(b, i, j), j == parent || v.MaskBit(b, parent, j)) << i << "," << j;
    }
  }
}

TEST(RandomBundle, MasksAreTrees) {
  for (auto fmt : {kernels::MaskFormat::kBytes, kernels::MaskFormat::kBits}) {
    for (TreeKind kind : {TreeKind::kChain, TreeKind::kRandomTree}) {
      RandomBundleSpec s = Spec(4);
      s.tree = kind;
      s.mask_format = fmt;
      RandomBundle rb(s);
      for (int b = 0; b < s.batch; ++b) ExpectTree(rb.view(), b, kind == TreeKind::kChain);
    }
  }
}

TEST(RandomBundle, BitsAndBytesDescribeTheSameTree) {
  RandomBundleSpec s = Spec(5);
  RandomBundle bytes(s);
  s.mask_format = kernels::MaskFormat::kBits;
  RandomBundle bits(s);
  EXPECT_EQ(bits.tree_mask.size(), size_t{3 * 17 * 3});
  for (int b = 0; b < s.batch; ++b) {
    for (int i = 0; i < s.draft; ++i) {
      for (int j = 0; j < s.draft; ++j) {
        ASSERT_EQ(bytes.view().MaskBit(b, i, j), bits.view().MaskBit(b, i, j));
      }
    }
  }
  EXPECT_EQ(bytes.q, bits.q);
}

TEST(RandomBundle, EmptyRow) {
  RandomBundleSpec s = Spec(6);
  s.empty_row = true;
  RandomBundle rb(s);
  const BundleView& v = rb.view();
  EXPECT_EQ(v.kv_lens[0], s.draft);  // prefix 0
  for (int j = 0; j < s.draft; ++j) EXPECT_FALSE(v.MaskBit(0, s.draft / 2, j));
  EXPECT_TRUE(v.MaskBit(1, s.draft / 2, s.draft / 2));
}

TEST(RandomBundle, SameSeedSameBundleOtherSeedOther) {
  RandomBundle a(Spec(7)), b(Spec(7)), c(Spec(8));
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.kv_pool, b.kv_pool);
  EXPECT_EQ(a.tree_mask, b.tree_mask);
  EXPECT_NE(a.q, c.q);
}

TEST(RandomBundle, QScale) {
  RandomBundleSpec s = Spec(9);
  RandomBundle one(s);
  s.q_scale = 8.f;
  RandomBundle eight(s);
  // x8 is exact in bf16.
  for (size_t k = 0; k < 100; ++k) {
    EXPECT_EQ(Bf16ToFloat(eight.q[k]), 8.f * Bf16ToFloat(one.q[k]));
  }
}

TEST(RandomBundle, TrafficNames) {
  Traffic t;
  ASSERT_TRUE(ParseTraffic("realistic", &t));
  EXPECT_EQ(t, Traffic::kRealistic);
  ASSERT_TRUE(ParseTraffic("random", &t));
  EXPECT_EQ(t, Traffic::kRandom);
  EXPECT_FALSE(ParseTraffic("Realistic", &t));
  EXPECT_FALSE(ParseTraffic("", &t));
  EXPECT_STREQ(TrafficName(Traffic::kRealistic), "realistic");
  EXPECT_STREQ(TrafficName(Traffic::kRandom), "random");
}

// Softmax weights (fp64) of draft token i, head h of request 0 over the keys it sees.
std::vector<double> Weights(const BundleView& v, int i, int h) {
  const int64_t kv_len = v.kv_lens[0], prefix = kv_len - v.shape.draft;
  const uint16_t* q = v.q + (int64_t{i} * v.shape.heads + h) * kHeadDimQK;
  std::vector<double> s(kv_len, -INFINITY);
  double m = -INFINITY;
  for (int64_t t = 0; t < kv_len; ++t) {
    if (t >= prefix && !v.MaskBit(0, i, static_cast<int>(t - prefix))) continue;
    const uint16_t* k = v.KvRow(0, t);
    double dot = 0;
    for (int d = 0; d < kHeadDimQK; ++d) dot += double{Bf16ToFloat(q[d])} * Bf16ToFloat(k[d]);
    s[t] = dot * v.sm_scale;
    m = std::max(m, s[t]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (double& x : s) x /= sum;
  return s;
}

struct Concentration {
  double sinks_recent_draft = 0;  // mean weight on tokens 0-1, the last 8 prefix, the draft
  double own_token_min = 1;       // smallest weight a draft token gives itself
  double own_token_mean = 0;
};

Concentration Measure(const RandomBundle& rb) {
  const BundleView& v = rb.view();
  const int T = v.shape.draft, H = v.shape.heads;
  const int64_t prefix = v.kv_lens[0] - T;
  Concentration c;
  for (int i = 0; i < T; ++i) {
    for (int h = 0; h < H; ++h) {
      const std::vector<double> w = Weights(v, i, h);
      double mass = w[0] + w[1];
      for (int64_t t = prefix - 8; t < prefix + T; ++t) mass += w[t];
      c.sinks_recent_draft += mass / (T * H);
      c.own_token_min = std::min(c.own_token_min, w[prefix + i]);
      c.own_token_mean += w[prefix + i] / (T * H);
    }
  }
  return c;
}

TEST(RandomBundle, RealisticTrafficConcentratesAttention) {
  for (int64_t prefix : {512, 16384}) {
    RandomBundleSpec s;
    s.draft = 8;
    s.heads = 2;
    s.page_size = 64;
    s.prefix = prefix;
    s.seed = 11;
    s.traffic = Traffic::kRealistic;
    RandomBundle real(s);
    BundleView checked = real.view();
    ASSERT_TRUE(ValidateBundle(checked).ok());
    const Concentration c = Measure(real);
    SCOPED_TRACE(prefix);
    // About 20 chosen keys of up to 16K carry most of the weight, and every draft token matters.
    EXPECT_GT(c.sinks_recent_draft, 0.5);
    const double uniform = 1.0 / static_cast<double>(prefix + s.draft);
    EXPECT_GT(c.own_token_min, 10 * uniform);
    EXPECT_GT(c.own_token_mean, 0.05);

    s.traffic = Traffic::kRandom;
    const Concentration diffuse = Measure(RandomBundle(s));
    EXPECT_LT(diffuse.sinks_recent_draft, 0.2);
    EXPECT_LT(diffuse.own_token_mean, 5 * uniform);
  }
}

TEST(RandomBundle, RealisticTrafficIsSeeded) {
  RandomBundleSpec s = Spec(12);
  s.traffic = Traffic::kRealistic;
  RandomBundle a(s), b(s);
  EXPECT_EQ(a.q, b.q);
  s.seed = 13;
  EXPECT_NE(a.q, RandomBundle(s).q);
  // The request with prefix 0 still gets finite queries (draft tokens only).
  for (uint16_t x : a.q) ASSERT_TRUE(std::isfinite(Bf16ToFloat(x)));
}

}  // namespace
}  // namespace verifyd
