#pragma once
// Host entry points of the GPU reference path: gather K rows, cuBLAS Q·Kᵀ (fp32 accumulation),
// masked softmax, cuBLAS P·V. Written independently of the custom kernel; shares no code with it.
// Also the on-device comparison reduction and the fp32 oracle.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Bytes of device workspace LaunchReference needs for `p`.
size_t ReferenceWorkspaceBytes(const VerifyProblem& p);

// Computes p.o (and p.lse when set) on `stream` with `handle` (its stream is set here).
cudaError_t LaunchReference(const VerifyProblem& p, void* workspace, size_t workspace_bytes,
                            cublasHandle_t handle, cudaStream_t stream);

}  // namespace verifyd::kernels
