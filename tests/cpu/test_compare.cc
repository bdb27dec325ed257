// The comparison module on hand-computed cases: norms, tolerances, NaN/Inf, -inf lse, zero ref.

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"

namespace verifyd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

std::vector<uint16_t> Bf16(const std::vector<float>& x) {
  std::vector<uint16_t> out;
  for (float f : x) out.push_back(FloatToBf16(f));
  return out;
}

TEST(Compare, HandComputedNorms) {
  // All values exact in bf16. diff = (0, 0.5, -1, 0): ||diff|| = sqrt(1.25), ||ref|| = sqrt(30).
  const std::vector<float> ref = {1, 2, 3, 4};
  const std::vector<uint16_t> test = Bf16({1, 2.5, 2, 4});
  Tolerance tol;
  tol.atol = 0.1;
  tol.rtol = 0.2;  // element limits: 0.3, 0.5, 0.7, 0.9 -> only |-1| > 0.7 fails (0.5 == 0.5)
  tol.atol_rel = 0;
  const DiffStats d = CompareBf16ToF32(test.data(), ref.data(), 4, nullptr, nullptr, 0, tol);
  EXPECT_EQ(d.count, 4);
  EXPECT_NEAR(d.rel_l2, std::sqrt(1.25 / 30.0), 1e-15);
  EXPECT_NEAR(d.nmse, 1.25 / 30.0, 1e-15);
  EXPECT_EQ(d.max_abs, 1.0);
  EXPECT_EQ(d.beyond_tol, 1);
  EXPECT_EQ(d.nan_test + d.inf_test + d.nan_ref + d.inf_ref, 0);
  EXPECT_TRUE(std::isnan(d.lse_max_abs));  // not compared
  EXPECT_EQ(d.rows, 1);
  EXPECT_NEAR(d.max_row_rel_l2, d.rel_l2, 1e-15);  // one row: the row figure is the global one
  EXPECT_EQ(d.worst_row, 0);
}

// Rows of kCompareRowLen: `scale * pattern`, every value exact in bf16.
std::vector<float> Rows(const std::vector<float>& scales) {
  std::vector<float> x;
  for (float s : scales) {
    for (int64_t k = 0; k < kCompareRowLen; ++k) x.push_back(s * static_cast<float>(k % 7 - 3));
  }
  return x;
}

TEST(Compare, ElementCheckScalesWithTheRow) {
  // Row 0 at scale 1, row 1 at scale 2^-10 (diffuse attention over a long prefix).
  const std::vector<float> ref = Rows({1.f, 0x1p-10f});
  std::vector<float> test = ref;
  test[kCompareRowLen + 5] += 0x1p-10f;  // an element of row 1 off by one of its own units
  test[7] += 0x1p-10f;                   // the same absolute error in row 0: rounding noise there
  const std::vector<uint16_t> t = Bf16(test);
  Tolerance tol;
  tol.atol_rel = 0.1;
  const DiffStats d = CompareBf16ToF32(t.data(), ref.data(), ref.size(), nullptr, nullptr, 0, tol);
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.beyond_tol, 1);  // only row 1's
  EXPECT_LT(d.rel_l2, 1e-3);   // invisible globally
  EXPECT_FALSE(Judge(d, tol).match);

  Tolerance legacy = tol;  // a fixed absolute floor swamps the small row
  legacy.atol = 1e-2;
  legacy.atol_rel = 0;
  EXPECT_EQ(
      CompareBf16ToF32(t.data(), ref.data(), ref.size(), nullptr, nullptr, 0, legacy).beyond_tol,
      0);
}

TEST(Compare, WorstRowRelL2) {
  const std::vector<float> ref = Rows({1.f, 1.f, 0x1p-6f, 1.f});
  std::vector<float> test = ref;
  for (int64_t k = 0; k < kCompareRowLen; ++k) test[2 * kCompareRowLen + k] *= 1.0625f;  // row 2
  const std::vector<uint16_t> t = Bf16(test);
  Tolerance tol;
  tol.max_beyond_tol = 1 << 20;  // judge by the row check alone
  const DiffStats d = CompareBf16ToF32(t.data(), ref.data(), ref.size(), nullptr, nullptr, 0, tol);
  EXPECT_NEAR(d.max_row_rel_l2, 0.0625, 1e-12);
  EXPECT_EQ(d.worst_row, 2);
  EXPECT_LT(d.rel_l2, 1e-3);
  const Verdict v = Judge(d, tol);
  EXPECT_FALSE(v.match);
  EXPECT_EQ(v.reason, "row rel_l2 0.0625 > 0.01 (row 2)");
}

TEST(Compare, WorstRowIsTheFirstOfEqualRows) {
  const std::vector<float> ref = Rows({1.f, 1.f, 1.f});
  std::vector<float> test = ref;
  test[kCompareRowLen + 1] = test[2 * kCompareRowLen + 1] = -1.f;  // rows 1 and 2 alike
  const std::vector<uint16_t> t = Bf16(test);
  const DiffStats d =
      CompareBf16ToF32(t.data(), ref.data(), ref.size(), nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.worst_row, 1);
  const DiffStats exact =
      CompareBf16ToF32(Bf16(ref).data(), ref.data(), ref.size(), nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(exact.worst_row, -1);
  EXPECT_EQ(exact.max_row_rel_l2, 0);
}

TEST(Compare, AllZeroReferenceRowMustStayZero) {
  // Row 1 is a fully masked query row: exact zero expected.
  const std::vector<float> ref = Rows({1.f, 0.f, 1.f});
  std::vector<float> test = ref;
  DiffStats d =
      CompareBf16ToF32(Bf16(test).data(), ref.data(), ref.size(), nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.zero_row_breaches, 0);
  EXPECT_TRUE(Judge(d, Tolerance{}).match);

  test[kCompareRowLen + 100] = 1e-30f;  // far below any absolute tolerance
  Tolerance loose;
  loose.atol = 1;
  loose.max_abs = 1;
  loose.max_beyond_tol = 1 << 20;
  loose.max_rel_l2 = 1;
  loose.max_row_rel_l2 = 1;
  d = CompareBf16ToF32(Bf16(test).data(), ref.data(), ref.size(), nullptr, nullptr, 0, loose);
  EXPECT_EQ(d.zero_row_breaches, 1);
  EXPECT_EQ(d.max_row_rel_l2, 0);  // zero rows are judged on their own, not as an inf ratio
  const Verdict v = Judge(d, loose);
  EXPECT_FALSE(v.match);
  EXPECT_EQ(v.reason, "nonzero output in 1 all-zero reference rows");
  EXPECT_EQ(
      CompareBf16ToF32(Bf16(test).data(), ref.data(), ref.size(), nullptr, nullptr, 0, Tolerance{})
          .beyond_tol,
      1);  // with the default atol 0 the element check flags it too
}

TEST(Compare, ShortLastRow) {
  std::vector<float> ref = Rows({1.f});
  ref.push_back(2.f);
  ref.push_back(-2.f);
  std::vector<float> test = ref;
  test.back() = -1.f;  // the 2-element last row: rel-L2 1/sqrt(8)
  const DiffStats d =
      CompareBf16ToF32(Bf16(test).data(), ref.data(), ref.size(), nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.worst_row, 1);
  EXPECT_NEAR(d.max_row_rel_l2, 1 / std::sqrt(8.0), 1e-12);
}

TEST(Compare, DefaultsAreScaleAware) {
  const Tolerance tol;
  EXPECT_EQ(tol.atol, 0);  // no absolute floor to swamp small outputs
  EXPECT_GT(tol.atol_rel, 0);
  EXPECT_GT(tol.max_row_rel_l2, 0);
}

TEST(Compare, Bf16AgainstBf16) {
  const std::vector<uint16_t> ref = Bf16({0.5, -0.25, 8});
  const std::vector<uint16_t> test = Bf16({0.5, -0.25, 8});
  const DiffStats d = CompareBf16(test.data(), ref.data(), 3, nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.rel_l2, 0);
  EXPECT_EQ(d.max_abs, 0);
  EXPECT_TRUE(Judge(d, Tolerance{}).match);
}

TEST(Compare, ZeroReference) {
  const std::vector<float> zero = {0, 0, 0};
  const std::vector<uint16_t> same = Bf16({0, -0.0f, 0});
  DiffStats d = CompareBf16ToF32(same.data(), zero.data(), 3, nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.rel_l2, 0);
  EXPECT_EQ(d.nmse, 0);
  EXPECT_TRUE(Judge(d, Tolerance{}).match);

  const std::vector<uint16_t> off = Bf16({0, 0.5, 0});
  d = CompareBf16ToF32(off.data(), zero.data(), 3, nullptr, nullptr, 0, Tolerance{});
  EXPECT_TRUE(std::isinf(d.rel_l2));
  EXPECT_TRUE(std::isinf(d.nmse));
  EXPECT_EQ(d.max_abs, 0.5);
  const Verdict v = Judge(d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("rel_l2 inf > 0.01"), std::string::npos) << v.reason;
}

TEST(Compare, NanAndInfCountedPerSideAndKeptOutOfNorms) {
  const std::vector<float> ref = {1, kNan, 2, kInf, 3};
  const std::vector<uint16_t> test = Bf16({1, kNan, kNan, kInf, -kInf});
  const DiffStats d =
      CompareBf16ToF32(test.data(), ref.data(), 5, nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.nan_test, 2);
  EXPECT_EQ(d.inf_test, 2);
  EXPECT_EQ(d.nan_ref, 1);
  EXPECT_EQ(d.inf_ref, 1);
  EXPECT_EQ(d.rel_l2, 0);      // only element 0 is finite on both sides
  EXPECT_EQ(d.beyond_tol, 2);  // NaN vs 2 and -inf vs 3; matching NaN/inf pairs are equal
  EXPECT_TRUE(std::isinf(d.max_abs));
  const Verdict v = Judge(d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("nan in test: 2, in ref: 1"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("inf in test: 2, in ref: 1"), std::string::npos) << v.reason;
}

TEST(Compare, NanInTestOnlyGivesReadableReason) {
  const std::vector<uint16_t> ref = Bf16({1, 2, 3});
  const std::vector<uint16_t> test = Bf16({kNan, 2, 3});
  const DiffStats d = CompareBf16(test.data(), ref.data(), 3, nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.nan_test, 1);
  EXPECT_EQ(d.nan_ref, 0);
  EXPECT_EQ(d.rel_l2, 0);
  const Verdict v = Judge(d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_EQ(v.reason.rfind("nan in test: 1", 0), 0u) << v.reason;
}

TEST(Compare, SameNanPositionsMatch) {
  const std::vector<uint16_t> ref = Bf16({kNan, 2});
  const std::vector<uint16_t> test = Bf16({kNan, 2});
  const DiffStats d = CompareBf16(test.data(), ref.data(), 2, nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(d.nan_test, 1);
  EXPECT_EQ(d.nan_ref, 1);
  EXPECT_TRUE(Judge(d, Tolerance{}).match) << Judge(d, Tolerance{}).reason;
}

TEST(Compare, NanPositionsDifferWithEqualCounts) {
  const std::vector<uint16_t> ref = Bf16({kNan, 2});
  const std::vector<uint16_t> test = Bf16({1, kNan});
  const DiffStats d = CompareBf16(test.data(), ref.data(), 2, nullptr, nullptr, 0, Tolerance{});
  const Verdict v = Judge(d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("nan/inf positions differ"), std::string::npos) << v.reason;
}

TEST(Compare, LseNegInfRowsAndMismatch) {
  const std::vector<uint16_t> o = Bf16({1});
  const std::vector<float> of = {1};
  const std::vector<float> ref_lse = {-kInf, 1.0f, 2.0f};
  std::vector<float> test_lse = {-kInf, 1.25f, 2.0f};
  DiffStats d =
      CompareBf16ToF32(o.data(), of.data(), 1, test_lse.data(), ref_lse.data(), 3, Tolerance{});
  EXPECT_EQ(d.lse_max_abs, 0.25);  // both -inf: equal
  Verdict v = Judge(d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("lse max_abs 0.25 > 0.01"), std::string::npos) << v.reason;

  test_lse = {0.0f, 1.0f, 2.0f};  // -inf on one side only
  d = CompareBf16ToF32(o.data(), of.data(), 1, test_lse.data(), ref_lse.data(), 3, Tolerance{});
  EXPECT_TRUE(std::isinf(d.lse_max_abs));
  EXPECT_FALSE(Judge(d, Tolerance{}).match);

  test_lse = ref_lse;
  d = CompareBf16ToF32(o.data(), of.data(), 1, test_lse.data(), ref_lse.data(), 3, Tolerance{});
  EXPECT_EQ(d.lse_max_abs, 0);
  EXPECT_TRUE(Judge(d, Tolerance{}).match);
}

// A bug that moves a little of a row's softmax mass (a draft key it should not see, or one it
// should, weighing 0.1% of the row) leaves the bf16 output within its rounding but shifts the
// fp32 lse by log(1.001): --max_lse_abs 1e-4 makes that a breach, while the largest clean
// difference measured on the GPU (1.14e-5 over 100,984 calls) passes. The default 1e-2 does not
// see it.
TEST(Compare, AOneInAThousandShiftOfARowsSoftmaxMassIsABreachThroughItsLse) {
  const std::vector<uint16_t> o = Bf16({0.5, -0.25, 8});
  const std::vector<float> of = {0.5, -0.25, 8};
  const std::vector<float> ref_lse = {12.5f, 3.0f};
  std::vector<float> test_lse = {12.5f + static_cast<float>(std::log1p(1e-3)), 3.0f};
  Tolerance tol;
  DiffStats d = CompareBf16ToF32(o.data(), of.data(), 3, test_lse.data(), ref_lse.data(), 2, tol);
  EXPECT_EQ(d.rel_l2, 0);
  EXPECT_TRUE(Judge(d, tol).match) << "the default limit sees the shift: update this test";

  tol.max_lse_abs = 1e-4;
  const Verdict v = Judge(d, tol);
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("lse max_abs 0.000999 > 0.0001"), std::string::npos) << v.reason;

  test_lse = {12.5f + 1.14e-5f, 3.0f};
  d = CompareBf16ToF32(o.data(), of.data(), 3, test_lse.data(), ref_lse.data(), 2, tol);
  EXPECT_TRUE(Judge(d, tol).match) << Judge(d, tol).reason;
}

TEST(Compare, JudgeReasons) {
  DiffStats d;
  d.count = 10;
  d.rel_l2 = 0.031;
  d.max_abs = 0.5;
  d.beyond_tol = 3;
  Tolerance tol;
  const Verdict v = Judge(d, tol);
  EXPECT_FALSE(v.match);
  EXPECT_EQ(v.reason, "rel_l2 0.031 > 0.01; max_abs 0.5 > 0.25; beyond_tol 3 > 0");
  tol.max_rel_l2 = 0.05;
  tol.max_abs = 1;
  tol.max_beyond_tol = 3;
  EXPECT_TRUE(Judge(d, tol).match);
  EXPECT_EQ(Judge(d, tol).reason, "");
}

}  // namespace
}  // namespace verifyd
