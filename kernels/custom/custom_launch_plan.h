#pragma once
// The plan LaunchCustom would use on the current device (tile configuration, KV split,
// workspace), for the benchmark's report and the tests' logs.

#include <cuda_runtime.h>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Which instructions compute Q·Kᵀ with the Hopper tiles. kAuto: wgmma on sm_90 devices,
// mma.sync elsewhere. kMmaSync: mma.sync everywhere (kept to compare and to fall back on).
enum class CustomScoreMma { kAuto, kMmaSync };

cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan,
                              CustomScoreMma mma = CustomScoreMma::kAuto);

// LaunchCustom with an explicit choice of the Q·Kᵀ instructions.
cudaError_t LaunchCustomWith(const VerifyProblem& p, const CustomConfig& c, CustomScoreMma mma,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace verifyd::kernels
