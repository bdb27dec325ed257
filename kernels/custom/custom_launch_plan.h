#pragma once
// The plan LaunchCustom would use on the current device (tile configuration, KV split,
// workspace), for the benchmark's report and the tests' logs.

#include <cuda_runtime.h>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan);

}  // namespace verifyd::kernels
