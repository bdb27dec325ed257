#pragma once
// The schedule and plan LaunchCustom would use on the current device (tile configuration, KV
// split, workspace), for the benchmark's report, the tests' logs and the in-process op; and the
// launch of a shipped schedule by name.

#include <cuda_runtime.h>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/custom/custom_schedule.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// kAuto resolves to v3e for an e4m3 pool and v5t otherwise on an sm_90 device, and to the sm_120
// tiles on any other device or with `small_smem`. A named schedule resolves to itself where it
// runs. Errors: cudaErrorNotSupported when the schedule does not run on this device or with this
// config (the Hopper tiles' schedules need sm_90 and no `small_smem`; an e4m3 pool needs v3e's
// device), cudaErrorInvalidValue when it does not read the pool's type.
cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan,
                              CustomSchedule schedule = CustomSchedule::kAuto);

// LaunchCustom with a shipped schedule named (ScheduleShipped); any other is refused
// (cudaErrorNotSupported): variants/custom_variants.h launches those.
cudaError_t LaunchCustomWith(const VerifyProblem& p, const CustomConfig& c, CustomSchedule schedule,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace verifyd::kernels
