// Every golden case (tests/data/golden/*.safetensors) through the CPU engine's oracle, reference
// and custom paths, against the stored fp64 answer; the e4m3 cases' answers come from
// make_golden.py's own decode of the e4m3 bytes, not from kernels/e4m3.h.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_engine.h"
#include "src/io/bundle_file.h"
#include "tests/common/e4m3_codes.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;

// Golden README: bf16-output paths land near rel-L2 2e-3 (output rounding alone ~1.5e-3); fp32
// paths far below 1e-5 before rounding.
constexpr double kReferenceMaxRelL2 = 3e-3;
constexpr double kCustomMaxRelL2 = 4e-3;
constexpr double kOracleMaxRelL2 = 1e-5;
constexpr double kOracleLseMaxAbs = 1e-5;  // relative to |lse| ~ 10: fp32 storage of fp64
constexpr double kCustomLseMaxAbs = 1e-3;

std::vector<std::string> GoldenCases() {
  std::vector<std::string> names;
  const fs::path dir = fs::path(VERIFYD_TEST_DATA) / "golden";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

double RelL2(const std::vector<float>& test, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double d = double{test[k]} - ref[k];
    num += d * d;
    den += double{ref[k]} * ref[k];
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, AllPathsMatchTheStoredOracle) {
  const std::string path =
      (fs::path(VERIFYD_TEST_DATA) / "golden" / (GetParam() + ".safetensors")).string();
  auto file = LoadBundleFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  BundleView v = file->view;
  ASSERT_TRUE(ValidateBundle(v).ok()) << ValidateBundle(v);
  ASSERT_NE(file->o_expected, nullptr);
  ASSERT_NE(file->lse_expected, nullptr);
  const float* o_exp = file->o_expected->as<float>();
  const float* lse_exp = file->lse_expected->as<float>();

  auto engine = MakeCpuEngine(2);
  auto pb = engine->Prepare(v, /*detach=*/false);
  ASSERT_TRUE(pb.ok()) << pb.status();
  PathOutput oracle, reference, custom;
  for (auto [p, out] : {std::pair{Path::kOracle, &oracle}, std::pair{Path::kReference, &reference},
                        std::pair{Path::kCustom, &custom}}) {
    ASSERT_TRUE(engine->Run(p, **pb).ok()) << PathName(p);
    ASSERT_TRUE(engine->Fetch(p, **pb, out).ok()) << PathName(p);
  }
  const int64_t n = v.o_elems(), n_lse = v.lse_elems();

  // NaN first: the golden pools are NaN outside every request's tokens.
  for (int64_t k = 0; k < n; ++k) ASSERT_TRUE(std::isfinite(oracle.o_f32[k])) << "oracle o " << k;
  const double oracle_rel = RelL2(oracle.o_f32, o_exp, n);
  EXPECT_LT(oracle_rel, kOracleMaxRelL2);

  const DiffStats ref = CompareBf16ToF32(reference.o.data(), o_exp, n, reference.lse.data(),
                                         lse_exp, n_lse, Tolerance{});
  const DiffStats cus =
      CompareBf16ToF32(custom.o.data(), o_exp, n, custom.lse.data(), lse_exp, n_lse, Tolerance{});
  EXPECT_EQ(ref.nan_test + ref.inf_test, 0);
  EXPECT_EQ(cus.nan_test + cus.inf_test, 0);
  EXPECT_LT(ref.rel_l2, kReferenceMaxRelL2);
  EXPECT_LT(cus.rel_l2, kCustomMaxRelL2);
  EXPECT_LE(ref.lse_max_abs, kOracleLseMaxAbs);
  EXPECT_LE(cus.lse_max_abs, kCustomLseMaxAbs);
  EXPECT_TRUE(Judge(cus, Tolerance{}).match) << Judge(cus, Tolerance{}).reason;

  // Rows that see nothing: lse -inf and exactly zero output on every path.
  int empty_rows = 0;
  double oracle_lse = 0;
  for (int64_t r = 0; r < n_lse; ++r) {
    if (std::isinf(lse_exp[r])) {
      ++empty_rows;
      EXPECT_EQ(oracle.lse[r], -INFINITY);
      EXPECT_EQ(reference.lse[r], -INFINITY);
      EXPECT_EQ(custom.lse[r], -INFINITY);
      for (int d = 0; d < kernels::kHeadDimV; ++d) {
        const int64_t k = r * kernels::kHeadDimV + d;
        ASSERT_EQ(oracle.o_f32[k], 0.f);
        ASSERT_EQ(reference.o[k], 0);
        ASSERT_EQ(custom.o[k], 0);
      }
    } else {
      oracle_lse = std::max(oracle_lse, std::fabs(double{oracle.lse[r]} - lse_exp[r]));
    }
  }
  EXPECT_LE(oracle_lse, kOracleLseMaxAbs);
  if (GetParam() == "tree_odd_sizes_page16" || GetParam() == "e4m3_tree_page64") {
    EXPECT_GT(empty_rows, 0);
  }
  std::printf(
      "%s: rel_l2 vs o_expected: oracle %.2g, reference %.3g, custom %.3g; lse max_abs "
      "oracle %.2g, custom %.2g; empty rows %d\n",
      GetParam().c_str(), oracle_rel, ref.rel_l2, cus.rel_l2, oracle_lse, cus.lse_max_abs,
      empty_rows);
}

INSTANTIATE_TEST_SUITE_P(Cases, Golden, ::testing::ValuesIn(GoldenCases()),
                         [](const auto& info) { return info.param; });

TEST(GoldenFiles, Present) {
  EXPECT_GE(GoldenCases().size(), 8u) << "golden cases missing under " << VERIFYD_TEST_DATA;
}

// The e4m3 cases (README.md, "FP8 KV caches"): pages of 1 and of 64 tokens, random draft trees,
// scales other than 1, and one whose requests read subnormal codes often enough that a decode
// that gets them wrong misses the answer.
TEST(GoldenFiles, E4m3CasesCoverPages1And64TreesAndScalesOtherThanOne) {
  std::set<int> pages;
  int e4m3 = 0;
  double most_subnormal = 0;
  for (const std::string& name : GoldenCases()) {
    auto file =
        LoadBundleFile((fs::path(VERIFYD_TEST_DATA) / "golden" / (name + ".safetensors")).string());
    ASSERT_TRUE(file.ok()) << file.status();
    const BundleView& v = file->view;
    if (v.shape.kv_dtype != kernels::KvDtype::kE4m3) {
      EXPECT_EQ(name.rfind("e4m3", 0), std::string::npos) << name << " has a bf16 pool";
      continue;
    }
    ++e4m3;
    pages.insert(v.shape.page_size);
    EXPECT_NE(v.kv_scale, 1.f) << name;
    EXPECT_EQ(file->metadata().at("kv_dtype"), "e4m3") << name;
    // A tree, not a chain: some draft token does not see every earlier one.
    bool branches = false;
    for (int b = 0; b < v.shape.batch; ++b) {
      for (int i = 0; i < v.shape.draft; ++i) {
        for (int j = 0; j < i; ++j) branches |= !v.MaskBit(b, i, j);
      }
    }
    EXPECT_TRUE(branches) << name;
    const E4m3Codes c = CountE4m3Codes(v);
    most_subnormal = std::max(most_subnormal, static_cast<double>(c.subnormal) / c.codes);
  }
  EXPECT_GE(e4m3, 2);
  EXPECT_TRUE(pages.count(1)) << "no e4m3 case with pages of 1";
  EXPECT_TRUE(pages.count(64)) << "no e4m3 case with pages of 64";
  EXPECT_GT(most_subnormal, 0.1);
}

}  // namespace
}  // namespace verifyd
