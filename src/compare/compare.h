#pragma once
// The one comparison of two attention outputs, used by tests, metrics, capture and replay.
// `test` is judged against `ref`: rel_l2 = ||test - ref|| / ||ref||.

#include <cstdint>
#include <limits>
#include <string>

namespace verifyd {

struct Tolerance {
  double atol = 1e-2;          // element check: |test - ref| <= atol + rtol * |ref|
  double rtol = 2e-2;
  double max_rel_l2 = 1e-2;    // breach when rel_l2 exceeds it
  double max_abs = 0.25;       // breach when max_abs exceeds it
  double max_lse_abs = 1e-2;   // breach when both have lse and they differ by more
  int64_t max_beyond_tol = 0;  // breach when more elements than this fail the element check
};

struct DiffStats {
  int64_t count = 0;           // elements compared
  double rel_l2 = 0;
  double max_abs = 0;
  double nmse = 0;             // mse(test, ref) / mse(ref, 0)
  int64_t beyond_tol = 0;
  int64_t nan_test = 0, inf_test = 0, nan_ref = 0, inf_ref = 0;
  double lse_max_abs = std::numeric_limits<double>::quiet_NaN();  // NaN: not compared
};

struct Verdict {
  bool match = true;
  std::string reason;  // empty on match; e.g. "rel_l2 0.031 > 0.01"
};

// bf16 test vs bf16 ref, or bf16 test vs fp32 ref (the oracle). lse arrays may be null.
// Rows where both lse are -inf count as equal; a -inf on one side only counts as difference inf.
DiffStats CompareBf16(const uint16_t* test, const uint16_t* ref, int64_t n, const float* test_lse,
                      const float* ref_lse, int64_t n_lse, const Tolerance& tol);
DiffStats CompareBf16ToF32(const uint16_t* test, const float* ref, int64_t n, const float* test_lse,
                           const float* ref_lse, int64_t n_lse, const Tolerance& tol);

// fp32 test (the oracle) vs fp32 ref (a golden file's fp64 answer stored as fp32).
DiffStats CompareF32(const float* test, const float* ref, int64_t n, const float* test_lse,
                     const float* ref_lse, int64_t n_lse, const Tolerance& tol);

Verdict Judge(const DiffStats& d, const Tolerance& tol);

}  // namespace verifyd
