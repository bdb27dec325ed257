#pragma once
// On-device comparison of two attention outputs with the definitions of src/compare/compare.h:
// a reduction over the output (and lse) whose few numbers are all that comes back to the host.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace verifyd::kernels {

enum class ElemType : int { kBf16 = 0, kF32 = 1 };

// A device tensor of `n` elements of `type`.
struct DeviceValues {
  const void* data = nullptr;
  ElemType type = ElemType::kBf16;
};

// The statistics of DiffStats, written by the reduction to device memory.
struct DeviceDiffStats {
  long long count;
  double rel_l2;
  double max_abs;
  double nmse;
  long long beyond_tol;
  long long nan_test, inf_test, nan_ref, inf_ref;
  double lse_max_abs;  // NaN when either lse pointer is null
  long long rows;
  double max_row_rel_l2;
  long long worst_row;  // -1 when every row is exact
  long long zero_row_breaches;
};

// The element and row limits of the comparison (Tolerance's element part) and the row length.
struct CompareLimits {
  long long row_len;  // elements per row (the last row may be shorter)
  double atol, atol_rel, rtol;
};

// Bytes of device workspace LaunchCompare needs (per-block partial sums; independent of n).
size_t CompareWorkspaceBytes();

// test/ref [n] (bf16 or fp32) as rows of limits.row_len, test_lse/ref_lse fp32 [n_lse] or null.
// Element check: |test - ref| <= atol + atol_rel * rms(ref row) + rtol * |ref|; per-row rel-L2,
// its maximum and the rows whose reference is all zero but test is not. Non-finite elements are
// counted and kept out of the norms; one that differs from the other side counts beyond
// tolerance and makes max_abs inf. One warp per row; the row sums follow the order that
// src/compare/compare.cc reproduces, so rms and the element check agree with the host bit for
// bit. Deterministic: a fixed grid and a fixed reduction order. Writes *out on `stream`.
cudaError_t LaunchCompare(DeviceValues test, DeviceValues ref, int64_t n, const float* test_lse,
                          const float* ref_lse, int64_t n_lse, const CompareLimits& limits,
                          void* workspace, size_t workspace_bytes, DeviceDiffStats* out,
                          cudaStream_t stream);

}  // namespace verifyd::kernels
