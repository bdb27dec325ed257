#pragma once
// The on-device comparison's few numbers as the comparison module's DiffStats.

#include "kernels/reference/compare_kernels.h"
#include "src/compare/compare.h"

namespace verifyd {

inline DiffStats ToDiffStats(const kernels::DeviceDiffStats& h) {
  DiffStats d;
  d.count = h.count;
  d.rel_l2 = h.rel_l2;
  d.max_abs = h.max_abs;
  d.nmse = h.nmse;
  d.beyond_tol = h.beyond_tol;
  d.nan_test = h.nan_test;
  d.inf_test = h.inf_test;
  d.nan_ref = h.nan_ref;
  d.inf_ref = h.inf_ref;
  d.lse_max_abs = h.lse_max_abs;
  d.rows = h.rows;
  d.max_row_rel_l2 = h.max_row_rel_l2;
  d.worst_row = h.worst_row;
  d.zero_row_breaches = h.zero_row_breaches;
  return d;
}

// The comparison's element and row limits for the on-device reduction.
inline kernels::CompareLimits ToCompareLimits(const Tolerance& tol) {
  return {kCompareRowLen, tol.atol, tol.atol_rel, tol.rtol};
}

}  // namespace verifyd
