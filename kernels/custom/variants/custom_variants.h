#pragma once
// The bench-only schedules of the custom kernel (custom_schedule.h), for verifyd-bench, the kernel
// tests and the trace: a new schedule is measured and tested here against the shipped one before
// it replaces it. verifyd itself links none of this.

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_schedule.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Any schedule, shipped or bench-only: a shipped one goes to LaunchCustomWith. The bench-only
// ones make none of the op's checks (a launch with them is refused, cudaErrorInvalidValue) and
// run on the Hopper tiles of an sm_90 device only (else cudaErrorNotSupported). The workspace is
// CustomVariantWorkspaceBytes'.
cudaError_t LaunchCustomVariant(const VerifyProblem& p, const CustomConfig& c,
                                CustomSchedule schedule, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

// Bytes of workspace LaunchCustomVariant needs for `p` under `schedule`; 0 where it cannot run.
size_t CustomVariantWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c,
                                   CustomSchedule schedule);

}  // namespace verifyd::kernels
