#pragma once
// Shared pieces of the GPU suites: the skip when no GPU is visible, and the thresholds and
// comparisons every path is held to against the fp64 oracle.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/compare/compare.h"

namespace verifyd {

inline int VisibleGpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define VERIFYD_SKIP_WITHOUT_GPU()                                                       \
  do {                                                                                   \
    if (::verifyd::VisibleGpus() == 0) {                                                 \
      GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount gave 0 or an error): " \
                      "GPU test skipped";                                                \
    }                                                                                    \
  } while (0)

// tests/data; the environment variable of the same name overrides the build's path (the GPU
// machine runs the binaries from another checkout).
inline std::string TestDataDir() {
  const char* env = std::getenv("VERIFYD_TEST_DATA");
  return env != nullptr && *env != '\0' ? env : VERIFYD_TEST_DATA;
}

// rel-L2 against the fp64 oracle. bf16 output rounding alone gives ~1.5e-3; the reference and
// custom paths add bf16 probabilities into P·V. The oracle kernel is fp32 throughout: its sums
// over thousands of keys stay within a few 1e-6.
inline constexpr double kReferenceMaxRelL2 = 5e-3;
inline constexpr double kCustomMaxRelL2 = 1e-2;
inline constexpr double kOracleMaxRelL2 = 2e-5;
inline constexpr double kLseMaxAbs = 1e-3;
inline constexpr double kOracleLseMaxAbs = 1e-4;

inline double RelL2(const std::vector<float>& test, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double d = double{test[k]} - ref[k];
    num += d * d;
    den += double{ref[k]} * ref[k];
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
}

// lse max-abs with both -inf equal and -inf on one side infinite (compare.h's rule).
inline double LseMaxAbs(const std::vector<float>& test, const float* ref, int64_t n) {
  double m = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double t = test[k], r = ref[k];
    const double d =
        t == r ? 0 : (std::isfinite(t) && std::isfinite(r) ? std::fabs(t - r) : INFINITY);
    m = std::max(m, d);
  }
  return m;
}

// The device reduction sums in another order than the host loop: counts are exact, sums agree
// to rounding.
inline void ExpectSameStats(const DiffStats& dev, const DiffStats& host) {
  EXPECT_EQ(dev.count, host.count);
  EXPECT_EQ(dev.beyond_tol, host.beyond_tol);
  EXPECT_EQ(dev.nan_test, host.nan_test);
  EXPECT_EQ(dev.inf_test, host.inf_test);
  EXPECT_EQ(dev.nan_ref, host.nan_ref);
  EXPECT_EQ(dev.inf_ref, host.inf_ref);
  EXPECT_EQ(dev.rows, host.rows);
  EXPECT_EQ(dev.worst_row, host.worst_row);
  EXPECT_EQ(dev.zero_row_breaches, host.zero_row_breaches);
  auto near = [](double a, double b) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    if (std::isinf(a) || std::isinf(b)) return a == b;
    return std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b)) + 1e-300;
  };
  EXPECT_PRED2(near, dev.rel_l2, host.rel_l2);
  EXPECT_PRED2(near, dev.nmse, host.nmse);
  EXPECT_PRED2(near, dev.max_abs, host.max_abs);
  EXPECT_PRED2(near, dev.lse_max_abs, host.lse_max_abs);
  EXPECT_PRED2(near, dev.max_row_rel_l2, host.max_row_rel_l2);
}

}  // namespace verifyd
