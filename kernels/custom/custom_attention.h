#pragma once
// Host entry points of the fused paged MLA tree-verify kernel (the "custom" path).
// Launchers only: no allocation, no host synchronization.

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

struct CustomConfig {
  bool small_smem = false;  // sm_120-sized tiles (~99 KB shared memory per block)
  int num_sms = 0;          // multiprocessors to plan the KV split for; 0 = ask the device
  int force_splits = 0;     // tests only: fixed KV split count; 0 = choose from the problem
  // Device word read when the kernels run: nonzero makes them write nothing (the in-process op's
  // checks failed). Null: they always run.
  const unsigned* skip = nullptr;
};

// Reads VERIFYD_FORCE_SM120_CONFIG=1 from the environment into `small_smem`.
CustomConfig CustomConfigFromEnv();

// Bytes of device workspace LaunchCustom needs for `p` (split-KV partials).
size_t CustomWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c);

// Computes p.o (and p.lse when set) on `stream`. `p` must have passed CheckShape() and the
// bundle validation; returns the launch error, if any.
cudaError_t LaunchCustom(const VerifyProblem& p, const CustomConfig& c, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream);

}  // namespace verifyd::kernels
