#include "src/compare/compare.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/common/bf16.h"

namespace verifyd {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Lanes of the on-device reduction of one row (one warp).
constexpr int kLanes = 32;

// Both sides are equal when they are the same non-finite value (NaN vs NaN, +inf vs +inf).
bool SameNonFinite(double t, double r) {
  return (std::isnan(t) && std::isnan(r)) || (std::isinf(t) && t == r);
}

void CountNonFinite(double x, int64_t* nan, int64_t* inf) {
  if (std::isnan(x)) ++*nan;
  if (std::isinf(x)) ++*inf;
}

// ||a|| / ||b|| with 0/0 = 0 and x/0 = inf.
double Ratio(double num, double den) {
  if (den > 0) return num / den;
  return num > 0 ? kInf : 0.0;
}

// sum of x[0..m) in the on-device order: lane l sums x[l], x[l+32], ... in turn, then the 32 lane
// sums combine by an xor butterfly (every lane ends with the same total; lane 0's is taken).
double LaneOrderSum(const double* x, int64_t m) {
  double s[kLanes] = {};
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int64_t k = lane; k < m; k += kLanes) s[lane] += x[k];
  }
  for (int off = kLanes / 2; off > 0; off /= 2) {
    double t[kLanes];
    for (int l = 0; l < kLanes; ++l) t[l] = s[l] + s[l ^ off];
    std::copy(t, t + kLanes, s);
  }
  return s[0];
}

double LseMaxAbs(const float* test_lse, const float* ref_lse, int64_t n_lse) {
  if (test_lse == nullptr || ref_lse == nullptr) return std::numeric_limits<double>::quiet_NaN();
  double max_abs = 0;
  for (int64_t i = 0; i < n_lse; ++i) {
    const double t = test_lse[i], r = ref_lse[i];
    double d;
    if (t == r) {
      d = 0;  // includes both -inf: rows that see nothing
    } else if (!std::isfinite(t) || !std::isfinite(r)) {
      d = kInf;
    } else {
      d = std::fabs(t - r);
    }
    if (d > max_abs) max_abs = d;
  }
  return max_abs;
}

template <typename TestAt, typename RefAt>
DiffStats CompareImpl(TestAt test_at, RefAt ref_at, int64_t n, const float* test_lse,
                      const float* ref_lse, int64_t n_lse, const Tolerance& tol) {
  DiffStats d;
  d.count = n;
  d.rows = (n + kCompareRowLen - 1) / kCompareRowLen;
  double diff_sq = 0, ref_sq = 0;
  // One row's finite pairs (non-finite ones enter as 0 and are judged on their own).
  std::vector<double> t(kCompareRowLen), r(kCompareRowLen), e2(kCompareRowLen), r2(kCompareRowLen);
  for (int64_t row = 0; row < d.rows; ++row) {
    const int64_t begin = row * kCompareRowLen;
    const int64_t m = std::min(kCompareRowLen, n - begin);
    for (int64_t k = 0; k < m; ++k) {
      t[k] = test_at(begin + k);
      r[k] = ref_at(begin + k);
      CountNonFinite(t[k], &d.nan_test, &d.inf_test);
      CountNonFinite(r[k], &d.nan_ref, &d.inf_ref);
      if (!std::isfinite(t[k]) || !std::isfinite(r[k])) {
        // Kept out of the norms; a mismatch makes max_abs inf so that Judge() always breaches.
        if (!SameNonFinite(t[k], r[k])) {
          ++d.beyond_tol;
          d.max_abs = kInf;
        }
        t[k] = r[k] = e2[k] = r2[k] = 0;
        continue;
      }
      const double e = std::fabs(t[k] - r[k]);
      e2[k] = e * e;
      r2[k] = r[k] * r[k];
      if (e > d.max_abs) d.max_abs = e;
    }
    const double row_diff_sq = LaneOrderSum(e2.data(), m);
    const double row_ref_sq = LaneOrderSum(r2.data(), m);
    diff_sq += row_diff_sq;
    ref_sq += row_ref_sq;
    const double rms = std::sqrt(row_ref_sq / static_cast<double>(m));
    const double row_limit = tol.atol + tol.atol_rel * rms;
    for (int64_t k = 0; k < m; ++k) {
      if (std::fabs(t[k] - r[k]) > row_limit + tol.rtol * std::fabs(r[k])) ++d.beyond_tol;
    }
    if (row_ref_sq > 0) {
      const double rel = std::sqrt(row_diff_sq / row_ref_sq);
      if (rel > d.max_row_rel_l2) {
        d.max_row_rel_l2 = rel;
        d.worst_row = row;
      }
    } else if (row_diff_sq > 0) {
      ++d.zero_row_breaches;
    }
  }
  d.nmse = Ratio(diff_sq, ref_sq);
  d.rel_l2 = std::sqrt(d.nmse);
  d.lse_max_abs = LseMaxAbs(test_lse, ref_lse, n_lse);
  return d;
}

void NonFiniteReason(const char* what, int64_t test, int64_t ref, std::vector<std::string>* why) {
  if (test == ref) return;
  if (ref == 0) {
    why->push_back(absl::StrFormat("%s in test: %d", what, test));
  } else if (test == 0) {
    why->push_back(absl::StrFormat("%s in ref: %d", what, ref));
  } else {
    why->push_back(absl::StrFormat("%s in test: %d, in ref: %d", what, test, ref));
  }
}

}  // namespace

DiffStats CompareBf16(const uint16_t* test, const uint16_t* ref, int64_t n, const float* test_lse,
                      const float* ref_lse, int64_t n_lse, const Tolerance& tol) {
  return CompareImpl([test](int64_t i) { return static_cast<double>(Bf16ToFloat(test[i])); },
                     [ref](int64_t i) { return static_cast<double>(Bf16ToFloat(ref[i])); }, n,
                     test_lse, ref_lse, n_lse, tol);
}

DiffStats CompareBf16ToF32(const uint16_t* test, const float* ref, int64_t n, const float* test_lse,
                           const float* ref_lse, int64_t n_lse, const Tolerance& tol) {
  return CompareImpl([test](int64_t i) { return static_cast<double>(Bf16ToFloat(test[i])); },
                     [ref](int64_t i) { return static_cast<double>(ref[i]); }, n, test_lse, ref_lse,
                     n_lse, tol);
}

DiffStats CompareF32(const float* test, const float* ref, int64_t n, const float* test_lse,
                     const float* ref_lse, int64_t n_lse, const Tolerance& tol) {
  return CompareImpl([test](int64_t i) { return static_cast<double>(test[i]); },
                     [ref](int64_t i) { return static_cast<double>(ref[i]); }, n, test_lse, ref_lse,
                     n_lse, tol);
}

Verdict Judge(const DiffStats& d, const Tolerance& tol) {
  std::vector<std::string> why;
  const bool counts_differ = d.nan_test != d.nan_ref || d.inf_test != d.inf_ref;
  NonFiniteReason("nan", d.nan_test, d.nan_ref, &why);
  NonFiniteReason("inf", d.inf_test, d.inf_ref, &why);
  if (!(d.rel_l2 <= tol.max_rel_l2)) {
    why.push_back(absl::StrFormat("rel_l2 %.3g > %g", d.rel_l2, tol.max_rel_l2));
  }
  if (!(d.max_row_rel_l2 <= tol.max_row_rel_l2)) {
    why.push_back(absl::StrFormat("row rel_l2 %.3g > %g (row %d)", d.max_row_rel_l2,
                                  tol.max_row_rel_l2, d.worst_row));
  }
  if (d.zero_row_breaches > 0) {
    why.push_back(
        absl::StrFormat("nonzero output in %d all-zero reference rows", d.zero_row_breaches));
  }
  if (!(d.max_abs <= tol.max_abs)) {
    if (!std::isinf(d.max_abs)) {
      why.push_back(absl::StrFormat("max_abs %.3g > %g", d.max_abs, tol.max_abs));
    } else if (!counts_differ) {
      why.push_back("nan/inf positions differ");
    }
  }
  if (d.beyond_tol > tol.max_beyond_tol) {
    why.push_back(absl::StrFormat("beyond_tol %d > %d", d.beyond_tol, tol.max_beyond_tol));
  }
  if (!std::isnan(d.lse_max_abs) && d.lse_max_abs > tol.max_lse_abs) {
    why.push_back(absl::StrFormat("lse max_abs %.3g > %g", d.lse_max_abs, tol.max_lse_abs));
  }
  Verdict v;
  v.match = why.empty();
  v.reason = absl::StrJoin(why, "; ");
  return v;
}

}  // namespace verifyd
