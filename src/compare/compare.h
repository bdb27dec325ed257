#pragma once
// The one comparison of two attention outputs, used by tests, metrics, capture and replay.
// `test` is judged against `ref`: rel_l2 = ||test - ref|| / ||ref||.
//
// The output is a sequence of rows of kCompareRowLen elements: one (query row, head) output
// vector each. Besides the global figures, every row is judged against its own scale:
//   element check  |test - ref| <= atol + atol_rel * rms(ref row) + rtol * |ref|
//   row check      ||test_row - ref_row|| / ||ref_row|| <= max_row_rel_l2
// so that one wrong row shows at any prefix length, however small attention makes the outputs.
// A row whose reference is all zero (a query row that sees nothing) must be all zero in test
// too: any nonzero element there is a breach (zero_row_breaches), whatever the tolerances.
// The on-device comparison (kernels/reference/compare_kernels.cu) computes the same figures; the
// per-row sums below follow its reduction order so that both agree bit for bit on rms.

#include <cstdint>
#include <limits>
#include <string>

#include "kernels/verify_problem.h"

namespace verifyd {

// Elements per row: one head's 512-dim output vector.
inline constexpr int64_t kCompareRowLen = kernels::kHeadDimV;

// Defaults derived from measured clean distributions (README, "Tolerance defaults").
struct Tolerance {
  double atol = 0;             // element check: |test - ref| <= atol + atol_rel * rms(ref row)
  double rtol = 2e-2;          //                                   + rtol * |ref|
  double max_rel_l2 = 1e-2;    // breach when rel_l2 exceeds it
  double max_abs = 0.25;       // breach when max_abs exceeds it
  double max_lse_abs = 1e-2;   // breach when both have lse and they differ by more (1e-4 measured
                               // clean and far more sensitive: docs/detection.md, "The lse limit")
  int64_t max_beyond_tol = 0;  // breach when more elements than this fail the element check
  double atol_rel = 2e-2;      // element check, part relative to the reference row's rms
  double max_row_rel_l2 = 1e-2;  // breach when any row's rel-L2 exceeds it
};

struct DiffStats {
  int64_t count = 0;  // elements compared
  double rel_l2 = 0;
  double max_abs = 0;
  double nmse = 0;  // mse(test, ref) / mse(ref, 0)
  int64_t beyond_tol = 0;
  int64_t nan_test = 0, inf_test = 0, nan_ref = 0, inf_ref = 0;
  double lse_max_abs = std::numeric_limits<double>::quiet_NaN();  // NaN: not compared
  int64_t rows = 0;               // rows of kCompareRowLen (the last one may be shorter)
  double max_row_rel_l2 = 0;      // largest ||test_row - ref_row|| / ||ref_row|| over rows whose
                                  // reference is not all zero
  int64_t worst_row = -1;         // the first row with that value; -1 when every row is exact
  int64_t zero_row_breaches = 0;  // rows whose reference is all zero but test is not
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
