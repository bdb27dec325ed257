// The invariance probes on the CPU engine: the bundles they rebuild hold the same attention, the
// clean custom path passes every check, and a custom path whose output depends on the split plan,
// the page size, the batch or the draft block's start fails the check that varies it, and only
// that one.

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "src/cpu_engine/cpu_engine.h"
#include "src/probe/invariance.h"
#include "src/probe/probe_runner.h"
#include "src/probe/repacked_bundle.h"

namespace verifyd {
namespace {

RandomBundleSpec Ragged() {
  RandomBundleSpec s;
  s.draft = 6;
  s.heads = 2;
  s.page_size = 16;
  s.prefix_lens = {61, 0, 130, 9};
  s.batch = 4;
  s.seed = 5;
  return s;
}

TEST(RepackedBundle, KeepsEveryRequestsTokensQueriesAndMask) {
  RandomBundle src(Ragged());
  RepackSpec spec;
  spec.requests = {2, 0, 2};
  spec.page_size = 1;
  spec.page_shuffle = 7;
  spec.draft_shift = 2;
  auto r = RepackedBundle::Make(src.view(), spec);
  ASSERT_TRUE(r.ok()) << r.status();
  const BundleView& v = r->view();
  ASSERT_EQ(v.shape.batch, 3);
  ASSERT_EQ(v.shape.draft, 4);
  EXPECT_EQ(v.shape.page_size, 1);
  const int T = v.shape.draft, H = v.shape.heads, Ts = src.view().shape.draft;
  for (int b = 0; b < 3; ++b) {
    const int s = spec.requests[b];
    ASSERT_EQ(v.kv_lens[b], src.view().kv_lens[s]);
    for (int64_t t = 0; t < v.kv_lens[b]; ++t) {
      ASSERT_EQ(0, std::memcmp(v.KvRow(b, t), src.view().KvRow(s, t), 576 * 2)) << b << " " << t;
    }
    for (int i = 0; i < T; ++i) {
      const int64_t row = int64_t{H} * 576;
      EXPECT_EQ(0, std::memcmp(v.q + (int64_t{b} * T + i) * row,
                               src.view().q + (int64_t{s} * Ts + i + 2) * row, row * 2));
      for (int j = 0; j < T; ++j)
        EXPECT_EQ(v.MaskBit(b, i, j), src.view().MaskBit(s, i + 2, j + 2));
      EXPECT_EQ(r->Comparable(b, i),
                src.view().MaskBit(s, i + 2, 0) && src.view().MaskBit(s, i + 2, 1));
    }
  }
  // The pages are spread over the pool, not in token order.
  bool in_order = true;
  for (int64_t i = 0; i < v.shape.num_indices; ++i) in_order = in_order && v.kv_indices[i] == i;
  EXPECT_FALSE(in_order);
}

TEST(RepackedBundle, RefusesWhatDoesNotFit) {
  RandomBundle src(Ragged());
  RepackSpec bad_request, bad_page, bad_shift;
  bad_request.requests = {4};
  bad_page.page_size = 3;
  bad_shift.draft_shift = 6;
  EXPECT_FALSE(RepackedBundle::Make(src.view(), bad_request).ok());
  EXPECT_FALSE(RepackedBundle::Make(src.view(), bad_page).ok());
  EXPECT_FALSE(RepackedBundle::Make(src.view(), bad_shift).ok());
}

TEST(InvarianceSplitCounts, EveryPlanOnceAndBothParities) {
  const std::vector<int> full = InvarianceSplitCounts(20, InvarianceSweep::kFull);
  std::map<int, int> plans;  // tiles per split -> count
  for (size_t i = 1; i < full.size(); ++i) ++plans[(20 + full[i] - 1) / full[i]];
  // ceil(20 / s) for s = 1..20 takes the values 20, 10, 7, 5, 4, 3, 2, 1.
  EXPECT_EQ(plans.size(), 8u);
  for (const auto& [tps, n] : plans) EXPECT_EQ(n, 1) << tps;
  const std::vector<int> fast = InvarianceSplitCounts(20, InvarianceSweep::kFast);
  bool even = false, odd = false;
  for (int s : fast) {
    const int tps = s > 0 ? (20 + s - 1) / s : 0;
    even |= tps > 1 && tps % 2 == 0;
    odd |= tps > 1 && tps % 2 == 1;
  }
  EXPECT_TRUE(even && odd);
  EXPECT_EQ(fast.front(), 0);
  EXPECT_EQ(fast.back(), 20);
  EXPECT_LT(fast.size(), full.size());
}

// The clean CPU custom path under a runner that can spoil its output where a check looks.
struct Spoiler {
  std::unique_ptr<Engine> engine = MakeCpuEngine(2);
  CustomRunner inner = EngineCustomRunner(*engine);
  BundleView loaded;
  // Called on each output with the loaded bundle and the split count.
  std::function<void(const BundleView&, int, PathOutput*)> spoil;
  CustomRunner Runner() {
    CustomRunner r = inner;
    r.load = [this](const BundleView& v) {
      loaded = v;
      return inner.load(v);
    };
    r.run = [this](int splits, PathOutput* out) {
      absl::Status st = inner.run(splits, out);
      if (st.ok() && spoil) spoil(loaded, splits, out);
      return st;
    };
    return r;
  }
};

std::map<std::string, InvarianceResult> RunAll(const CustomRunner& runner, InvarianceSweep sweep) {
  std::map<std::string, InvarianceResult> by_check;
  for (const InvarianceCase& c : InvarianceCases(2048, runner.tile_tokens)) {
    for (InvarianceResult& r : RunInvarianceChecks(runner, c, sweep)) {
      const std::string check = r.name.substr(r.name.rfind('/') + 1);
      auto [it, fresh] = by_check.emplace(check, r);
      if (!fresh && !r.passed && it->second.passed) it->second = r;
    }
  }
  return by_check;
}

TEST(Invariance, CleanCustomPathPassesEveryCheck) {
  Spoiler s;
  for (InvarianceSweep sweep : {InvarianceSweep::kFast, InvarianceSweep::kFull}) {
    const auto got = RunAll(s.Runner(), sweep);
    for (const char* check :
         {"split_plan", "page_size", "page_order", "batch", "padding", "draft_shift"}) {
      ASSERT_TRUE(got.count(check)) << check;
      const InvarianceResult& r = got.at(check);
      EXPECT_TRUE(r.passed) << r.name << ": " << r.reason;
      EXPECT_GT(r.runs, 0) << r.name;
      EXPECT_GT(r.agreement.rows, 0) << r.name;
      std::printf("[ invariance ] %-36s runs %3d rows %6lld row rel-L2 max %.3g lse max %.3g%s\n",
                  r.name.c_str(), r.runs, static_cast<long long>(r.agreement.rows),
                  r.agreement.max_row_rel_l2, r.agreement.max_lse_abs,
                  r.agreement.exact() ? " (bit-identical)" : "");
    }
    EXPECT_TRUE(got.at("page_size").agreement.exact());
    EXPECT_TRUE(got.at("page_order").agreement.exact());
  }
}

// Only `failing` fails when the output is spoiled by `spoil`.
void ExpectOnlyFails(const std::function<void(const BundleView&, int, PathOutput*)>& spoil,
                     const std::string& failing) {
  Spoiler s;
  s.spoil = spoil;
  for (const auto& [check, r] : RunAll(s.Runner(), InvarianceSweep::kFull)) {
    if (check == failing) {
      EXPECT_FALSE(r.passed) << check;
      std::printf("[ caught     ] %s: %s\n", r.name.c_str(), r.reason.c_str());
    } else if (check != "padding" || failing != "batch") {  // padding compares with alone too
      EXPECT_TRUE(r.passed) << check << ": " << r.reason;
    }
  }
}

TEST(Invariance, OutputThatDependsOnTheSplitPlanFailsSplitPlan) {
  ExpectOnlyFails(
      [](const BundleView&, int splits, PathOutput* out) {
        if (splits != 3) return;
        for (int d = 0; d < 64; ++d) out->o[d] ^= 0x0040;  // 64 elements of row 0, ~10%
      },
      "split_plan");
}

TEST(Invariance, OneUlpThatDependsOnThePageSizeFailsPageSize) {
  ExpectOnlyFails(
      [](const BundleView& v, int, PathOutput* out) {
        if (v.shape.page_size == 1) out->o[3] ^= 1;  // far under any tolerance: exactness
      },
      "page_size");
}

TEST(Invariance, LseThatDependsOnTheBatchFailsBatch) {
  ExpectOnlyFails(
      [](const BundleView& v, int, PathOutput* out) {
        if (v.shape.batch == 1 && std::isfinite(out->lse[0])) out->lse[0] += 1e-3f;
      },
      "batch");
}

TEST(Invariance, RowsThatDependOnTheDraftStartFailDraftShift) {
  ExpectOnlyFails(
      [](const BundleView& v, int, PathOutput* out) {
        if (v.shape.draft < 5) {
          for (size_t i = 0; i < out->o.size(); i += 97) out->o[i] ^= 0x0200;
        }
      },
      "draft_shift");
}

// What the probe scheduler runs: every check of both cases as a probe of the report, the full sweep
// on demand; a custom path that writes NaN fails them.
TEST(InvarianceProbes, AppendOneProbePerCheckAndCase) {
  std::unique_ptr<Engine> engine = MakeCpuEngine(2);
  ProbeReport report;
  report.seconds = 1;
  RunInvarianceProbes(*engine, 256, InvarianceSweep::kFull, &report);
  ASSERT_EQ(report.results.size(), 12u);
  EXPECT_TRUE(report.passed()) << report.Summary();
  EXPECT_GT(report.seconds, 1);
  for (const ProbeResult& p : report.results) {
    EXPECT_EQ(p.name.rfind("invariance/", 0), 0u) << p.name;
    EXPECT_NE(p.feature.find("against itself"), std::string::npos);
  }
  CustomFault nan;
  nan.kind = CustomFault::Kind::kNan;
  engine->InjectCustomFault(nan);
  ProbeReport bad;
  RunInvarianceProbes(*engine, 256, InvarianceSweep::kFast, &bad);
  EXPECT_FALSE(bad.passed());
  EXPECT_GE(bad.failures, 2);
  EXPECT_NE(bad.Summary().find("non-finite"), std::string::npos) << bad.Summary();
}

}  // namespace
}  // namespace verifyd
