#pragma once
// The launch of a planned kernel and, when the KV is split, of its combine: shared by the shipped
// launcher (custom_attention.cu) and the bench-only variants (variants/custom_variants.cu).

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/custom/kernel_params.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels::custom {

using KernelFn = void (*)(KernelParams);

// What every launch refuses before it plans: a shape CheckShape refuses, max_kv_len outside
// [T, kMaxPrefix + kMaxDraft], an e4m3 pool's kv_scale or the o_scale not finite and > 0.
bool ProblemRefused(const VerifyProblem& p);

// A workspace short of what `plan` needs.
bool WorkspaceShort(const CustomPlan& plan, const void* workspace, size_t workspace_bytes);

// Sets `kernel`'s dynamic shared memory to its tiles' on the current device, once per device.
cudaError_t PrepareKernel(KernelFn kernel, const CustomTileShape& tiles);

// Launches `kernel` on plan.tiles over the plan's grid and, when the KV is split, the combine: as
// a programmatic dependent with `dependent_combine` (the kernel then calls LaunchDependents).
// The refusals (shape, schedule against pool type, checks, workspace) are the caller's.
cudaError_t LaunchPlanned(KernelFn kernel, bool dependent_combine, const VerifyProblem& p,
                          const CustomPlan& plan, const CustomConfig& c, void* workspace,
                          cudaStream_t stream);

}  // namespace verifyd::kernels::custom
