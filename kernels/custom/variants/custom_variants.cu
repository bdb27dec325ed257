#include "kernels/custom/variants/custom_variants.h"

#include "kernels/custom/custom_launch.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/fused_verify_kernel.cuh"
#include "kernels/custom/pair_seesaw_kernel.cuh"
#include "kernels/custom/tile_config.cuh"

namespace verifyd::kernels {
namespace {

using custom::HopperTiles;

struct VariantKernel {
  custom::KernelFn kernel = nullptr;
  bool dependent_combine = false;  // the kernel calls LaunchDependents for its combine
};

VariantKernel KernelOf(CustomSchedule s) {
  switch (s) {
    case CustomSchedule::kV5:
      return {custom::PairSeesawKernel<HopperTiles, false>, true};
    case CustomSchedule::kV5s:
      return {custom::PairSeesawKernel<HopperTiles, true>, true};
    case CustomSchedule::kV4:
      return {custom::FusedVerifyKernel<HopperTiles, true, true, true>, true};
    case CustomSchedule::kV4SplitK:
      return {custom::FusedVerifyKernel<HopperTiles, true, true, true, true>, true};
    case CustomSchedule::kV4TwoChain:
      return {custom::FusedVerifyKernel<HopperTiles, true, true, true, false, true>, true};
    case CustomSchedule::kV3:
      return {custom::FusedVerifyKernel<HopperTiles, true, true>, false};
    case CustomSchedule::kWgmmaScores:
      return {custom::FusedVerifyKernel<HopperTiles, true, false>, false};
    case CustomSchedule::kMmaSync:
      return {custom::FusedVerifyKernel<HopperTiles, false, false>, false};
    default:
      return {};
  }
}

}  // namespace

size_t CustomVariantWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c,
                                   CustomSchedule schedule) {
  CustomPlan plan;
  return ResolveCustomPlan(p, c, &plan, schedule) == cudaSuccess ? plan.workspace_bytes : 0;
}

cudaError_t LaunchCustomVariant(const VerifyProblem& p, const CustomConfig& c,
                                CustomSchedule schedule, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  if (ScheduleShipped(schedule)) {
    return LaunchCustomWith(p, c, schedule, workspace, workspace_bytes, stream);
  }
  // None of these reads an e4m3 pool's codes (v3e, shipped, does) or makes the op's checks.
  const VariantKernel v = KernelOf(schedule);
  if (v.kernel == nullptr || c.checks.words != nullptr || p.shape.kv_dtype != KvDtype::kBf16 ||
      custom::ProblemRefused(p)) {
    return cudaErrorInvalidValue;
  }
  CustomPlan plan;
  if (cudaError_t e = ResolveCustomPlan(p, c, &plan, schedule); e != cudaSuccess) return e;
  if (custom::WorkspaceShort(plan, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  if (cudaError_t e = custom::PrepareKernel(v.kernel, plan.tiles); e != cudaSuccess) return e;
  return custom::LaunchPlanned(v.kernel, v.dependent_combine, p, plan, c, workspace, stream);
}

}  // namespace verifyd::kernels
