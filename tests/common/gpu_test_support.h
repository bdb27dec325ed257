#pragma once
// Test support shared by the GPU suites (the kernels' and the CUDA engine's): the skip when no
// GPU is usable, the test data folder, and the one set of error limits each path is held to
// against the fp64 oracle (figures from src/compare/compare.h). Device buffers with guard bytes
// are in device_bundle.h.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/verify_problem.h"
#include "src/compare/compare.h"
#include "tests/common/device_bundle.h"

namespace verifyd::testing {

// Why the GPU suites skip, or "" when a device is usable.
inline std::string NoGpuReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
  }
  if (n == 0) return "no CUDA device present";
  return "";
}

#define VERIFYD_SKIP_WITHOUT_GPU()                                                 \
  do {                                                                             \
    if (const std::string why = ::verifyd::testing::NoGpuReason(); !why.empty()) { \
      GTEST_SKIP() << why << ": GPU test skipped";                                 \
    }                                                                              \
  } while (0)

// tests/data; the environment variable of the same name overrides the build's path (the GPU
// machine runs the binaries from another checkout).
inline std::string TestDataDir() {
  const char* env = std::getenv("VERIFYD_TEST_DATA");
  return env != nullptr && *env != '\0' ? env : VERIFYD_TEST_DATA;
}

// Error limits against the fp64 oracle, over every checked row. bf16 output rounding alone gives
// ~1.5e-3 rel-L2; the reference and custom paths add bf16 probabilities into P·V. max-abs: the
// bf16 ulp at |x| in [2, 4) is 0.0156. lse: natural log, fp32. The oracle path is fp32
// throughout: its sums over thousands of keys stay within a few 1e-6. NaN fails every limit.
inline constexpr double kReferenceMaxRelL2 = 5e-3;
inline constexpr double kCustomMaxRelL2 = 5e-3;
inline constexpr double kMaxAbs = 3e-2;
inline constexpr double kLseMaxAbs = 1e-3;
inline constexpr double kOracleMaxRelL2 = 2e-5;
inline constexpr double kOracleLseMaxAbs = 1e-4;
// Custom against reference: each within its limit of the oracle (triangle inequality).
inline constexpr double kCustomVsReferenceMaxRelL2 = kReferenceMaxRelL2 + kCustomMaxRelL2;

// A problem of one small request (B 1, T 4, H 2, 40 keys on 4 pages of 16) with no tensors, for
// the launches a test expects refused before anything touches a device.
inline kernels::VerifyProblem TinyProblem() {
  kernels::VerifyProblem p;
  p.shape.batch = 1;
  p.shape.draft = 4;
  p.shape.heads = 2;
  p.shape.page_size = 16;
  p.shape.num_pages = 4;
  p.shape.num_indices = 4;
  p.max_kv_len = 40;
  p.total_kv_len = 40;
  p.sm_scale = 0.07f;
  return p;
}

// rel-L2 and lse max-abs of an fp32 output against fp32 figures, by compare.h's rules (0/0 is 0,
// x/0 is inf; both -inf equal, -inf on one side only infinite).
inline double RelL2(const std::vector<float>& test, const float* ref, int64_t n) {
  return CompareF32(test.data(), ref, n, nullptr, nullptr, 0, Tolerance{}).rel_l2;
}
inline double LseMaxAbs(const std::vector<float>& test, const float* ref, int64_t n) {
  return CompareF32(nullptr, nullptr, 0, test.data(), ref, n, Tolerance{}).lse_max_abs;
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

}  // namespace verifyd::testing
