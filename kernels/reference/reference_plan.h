#pragma once
// How the GPU reference path cuts a problem into chunks whose workspace stays bounded.
// The plan depends only on host-side values of VerifyProblem (shape, max_kv_len).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Upper bound on the K / score / probability buffers of one chunk (the cuBLAS workspace is
// extra). Larger problems run as several chunks on the same stream, one after the other.
inline constexpr size_t kReferenceChunkBudget = size_t{2} << 30;
inline constexpr size_t kReferenceCublasWorkspace = size_t{32} << 20;

// One chunk is `requests` requests x `rows` query rows (of the T*H rows of a request).
// When a whole request does not fit, `requests` is 1 and the request's rows are split.
struct ReferencePlan {
  int64_t kv_stride = 0;   // padded KV length Lp (>= max_kv_len, multiple of 32)
  int64_t rows_total = 0;  // M = T*H query rows per request
  int requests = 0;        // requests per chunk
  int64_t rows = 0;        // query rows per chunk and request
  // Byte offsets into the workspace, each 256-aligned.
  size_t cublas_offset = 0;  // cuBLAS workspace
  size_t k_offset = 0;       // bf16 [requests, Lp, 576] gathered K (V = first 512 dims)
  size_t s_offset = 0;       // fp32 [requests, rows, Lp] scores
  size_t p_offset = 0;       // bf16 [requests, rows, Lp] probabilities
  size_t total_bytes = 0;
};

ReferencePlan PlanReference(const VerifyProblem& p, size_t chunk_budget = kReferenceChunkBudget);

// LaunchReference with an explicit plan (tests force small chunks with a small budget).
cudaError_t LaunchReferencePlanned(const VerifyProblem& p, const ReferencePlan& plan,
                                   void* workspace, size_t workspace_bytes, cublasHandle_t handle,
                                   cudaStream_t stream);

}  // namespace verifyd::kernels
