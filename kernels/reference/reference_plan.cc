#include "kernels/reference/reference_plan.h"

#include <algorithm>

namespace verifyd::kernels {
namespace {

constexpr size_t kAlign = 256;
constexpr int64_t kKvPad = 32;  // keeps score rows 128-byte and probability rows 64-byte aligned

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

ReferencePlan PlanReference(const VerifyProblem& p, size_t chunk_budget) {
  ReferencePlan plan;
  const int64_t max_len = std::max<int64_t>(p.max_kv_len, 1);
  plan.kv_stride = (max_len + kKvPad - 1) / kKvPad * kKvPad;
  plan.rows_total = int64_t{p.shape.draft} * p.shape.heads;

  const size_t k_bytes = AlignUp(size_t(plan.kv_stride) * kHeadDimQK * 2);
  // Scores (fp32) and probabilities (bf16) of one query row.
  const size_t row_bytes = size_t(plan.kv_stride) * (4 + 2);
  const size_t request_bytes = k_bytes + size_t(plan.rows_total) * row_bytes;
  const int batch = std::max(p.shape.batch, 1);
  if (request_bytes <= chunk_budget) {
    plan.requests = static_cast<int>(std::min<size_t>(batch, chunk_budget / request_bytes));
    plan.rows = plan.rows_total;
  } else {
    plan.requests = 1;
    const size_t room = chunk_budget > k_bytes ? chunk_budget - k_bytes : 0;
    plan.rows = std::clamp<int64_t>(static_cast<int64_t>(room / row_bytes), 1, plan.rows_total);
  }

  const size_t n = size_t(plan.requests);
  const size_t elems = n * size_t(plan.rows) * size_t(plan.kv_stride);
  plan.cublas_offset = 0;
  plan.k_offset = AlignUp(kReferenceCublasWorkspace);
  plan.s_offset = plan.k_offset + n * k_bytes;
  plan.p_offset = plan.s_offset + AlignUp(elems * 4);
  plan.total_bytes = plan.p_offset + AlignUp(elems * 2);
  return plan;
}

}  // namespace verifyd::kernels
