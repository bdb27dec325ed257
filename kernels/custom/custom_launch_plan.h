#pragma once
// The plan LaunchCustom would use on the current device (tile configuration, KV split,
// workspace), for the benchmark's report and the tests' logs.

#include <cuda_runtime.h>

#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Which instructions and schedule the Hopper tiles use. kAuto: the shipped choice, v5t
// (kWgmmaPairSeesawTailMask) on sm_90 devices, mma.sync elsewhere. kWgmmaV3: wgmma
// for both, both warpgroups' softmax in step (v3). kWgmmaSeesaw: wgmma for both, the
// warpgroups' softmax and P·V in turn, combine as a programmatic dependent launch (v4).
// kWgmmaSeesawSplitK: v4 with Q·Kᵀ as m64n64 per warpgroup over half of the 576 dims.
// kWgmmaSeesaw2Chain: v4 with Q·Kᵀ's k steps in two accumulator chains (even, odd) per warpgroup.
// kWgmmaPairSeesaw: v5, the seesaw at tile granularity (pair_seesaw_kernel.cuh): each warpgroup
// the whole Q·Kᵀ of one of a step's two tiles, loads per 64-dim block behind mbarriers.
// kWgmmaPairSeesawStaggered: v5s, v5 with warpgroup 1's Q·Kᵀ issued after warpgroup 0's is done.
// kWgmmaPairSeesawTailMask: v5t, v5 with the steps of prefix keys only compiled without the tree
// mask, and the steps from the first tile that reaches the draft keys in a masked copy.
// kWgmmaV3E4m3: v3 on an e4m3 pool, reading its codes (half the bytes) and widening them to bf16
// in shared memory; the only choice that takes an e4m3 problem, and it takes nothing else.
// kWgmmaScores: wgmma for Q·Kᵀ only. kMmaSync: mma.sync everywhere. The narrower choices stay
// to compare against and to fall back on.
enum class CustomScoreMma {
  kAuto,
  kWgmmaScores,
  kMmaSync,
  kWgmmaV3,
  kWgmmaSeesaw,
  kWgmmaSeesawSplitK,
  kWgmmaSeesaw2Chain,
  kWgmmaPairSeesaw,
  kWgmmaPairSeesawStaggered,
  kWgmmaPairSeesawTailMask,
  kWgmmaV3E4m3
};

cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan,
                              CustomScoreMma mma = CustomScoreMma::kAuto);

// LaunchCustom with an explicit choice of the Q·Kᵀ instructions.
cudaError_t LaunchCustomWith(const VerifyProblem& p, const CustomConfig& c, CustomScoreMma mma,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace verifyd::kernels
