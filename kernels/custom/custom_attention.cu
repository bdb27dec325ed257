#include "kernels/custom/custom_attention.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/custom/fused_verify_kernel.cuh"
#include "kernels/custom/kernel_params.h"
#include "kernels/custom/pair_seesaw_kernel.cuh"
#include "kernels/custom/split_combine_kernel.cuh"
#include "kernels/custom/tile_config.cuh"

namespace verifyd::kernels {
namespace {

using custom::HopperTiles;
using custom::KernelParams;
using custom::Sm120Tiles;

// The planner's view of the tiles must be the kernels' own.
template <class Cfg>
constexpr bool SameShape(CustomTileShape s) {
  return s.rows == Cfg::kRows && s.tokens == Cfg::kTokens && s.stages == Cfg::kStages &&
         s.threads == Cfg::kThreads && s.smem_bytes == Cfg::kSmemBytes;
}
static_assert(SameShape<HopperTiles>(HopperTileShape()), "Hopper tile shape");
static_assert(SameShape<Sm120Tiles>(Sm120TileShape()), "sm_120 tile shape");

// What a launch needs to know about a device, read once per device: the kernels' shared-memory
// attribute is set at the same time.
struct DeviceFacts {
  bool ready = false;
  cudaError_t error = cudaSuccess;
  int sms = 0;
  bool wgmma = false;  // sm_90: the binary carries sm_90a code with wgmma
  bool hopper_tiles_fit = false;
  int ctas_hopper = 0;
  int ctas_sm120 = 0;
};

constexpr int kMaxDevices = 64;

cudaError_t QueryDevice(int dev, DeviceFacts* f) {
  cudaError_t e = cudaDeviceGetAttribute(&f->sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return e;
  int optin = 0, major = 0, minor = 0;
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) return e;
  f->wgmma = major == 9 && minor == 0;
  f->hopper_tiles_fit = static_cast<size_t>(optin) >= HopperTiles::kSmemBytes;
  if (f->hopper_tiles_fit) {
    for (auto* k : {custom::FusedVerifyKernel<HopperTiles, true, true, true, false, true>,
                    custom::FusedVerifyKernel<HopperTiles, true, true, true, true>,
                    custom::FusedVerifyKernel<HopperTiles, true, true, true>,
                    custom::FusedVerifyKernel<HopperTiles, true, true>,
                    custom::FusedVerifyKernel<HopperTiles, true, false>,
                    custom::FusedVerifyKernel<HopperTiles, false, false>,
                    custom::PairSeesawKernel<HopperTiles, false>,
                    custom::PairSeesawKernel<HopperTiles, true>,
                    custom::PairSeesawKernel<HopperTiles, false, true>}) {
      e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(HopperTiles::kSmemBytes));
      if (e != cudaSuccess) return e;
    }
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &f->ctas_hopper, custom::FusedVerifyKernel<HopperTiles, true, true>, HopperTiles::kThreads,
        HopperTiles::kSmemBytes);
    if (e != cudaSuccess) return e;
  }
  auto* k = custom::FusedVerifyKernel<Sm120Tiles, false, false>;
  e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Sm120Tiles::kSmemBytes));
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f->ctas_sm120, k, Sm120Tiles::kThreads,
                                                       Sm120Tiles::kSmemBytes);
}

cudaError_t CurrentDeviceFacts(DeviceFacts* out) {
  static std::mutex mu;
  static std::array<DeviceFacts, kMaxDevices> facts;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mu);
  DeviceFacts& f = facts[dev];
  if (!f.ready) {
    f.error = QueryDevice(dev, &f);
    f.ready = true;
  }
  *out = f;
  return f.error;
}

struct ResolvedPlan {
  CustomPlan plan;
  cudaError_t error = cudaSuccess;
};

// The schedules whose kernels make the op's checks (kernel_checks.cuh): v5t.
bool InKernelChecks(const CustomPlan& plan) {
  return plan.pair_seesaw && plan.tail_mask && !plan.small_tiles;
}

ResolvedPlan Resolve(const VerifyProblem& p, const CustomConfig& c, CustomScoreMma mma) {
  ResolvedPlan r;
  DeviceFacts f;
  r.error = CurrentDeviceFacts(&f);
  if (r.error != cudaSuccess) return r;
  const bool small = c.small_smem || !f.hopper_tiles_fit;
  const int sms = c.num_sms > 0 ? c.num_sms : f.sms;
  const int ctas = small ? f.ctas_sm120 : f.ctas_hopper;
  if (ctas < 1) {
    r.error = cudaErrorInvalidConfiguration;
    return r;
  }
  r.plan = PlanCustom(p, small, sms, ctas, c.force_splits);
  r.plan.wgmma_scores = !small && f.wgmma && mma != CustomScoreMma::kMmaSync;
  r.plan.wgmma_pv =
      r.plan.wgmma_scores &&
      (mma == CustomScoreMma::kAuto || mma == CustomScoreMma::kWgmmaV3 ||
       mma == CustomScoreMma::kWgmmaSeesaw || mma == CustomScoreMma::kWgmmaSeesawSplitK ||
       mma == CustomScoreMma::kWgmmaSeesaw2Chain || mma == CustomScoreMma::kWgmmaPairSeesaw ||
       mma == CustomScoreMma::kWgmmaPairSeesawStaggered ||
       mma == CustomScoreMma::kWgmmaPairSeesawTailMask || mma == CustomScoreMma::kWgmmaV3E4m3);
  // v3e: v3 reading e4m3 codes; only where v3's wgmma runs (the Hopper tiles on sm_90).
  r.plan.e4m3_loads = r.plan.wgmma_pv && mma == CustomScoreMma::kWgmmaV3E4m3;
  r.plan.seesaw = r.plan.wgmma_pv && (mma == CustomScoreMma::kWgmmaSeesaw ||
                                      mma == CustomScoreMma::kWgmmaSeesawSplitK ||
                                      mma == CustomScoreMma::kWgmmaSeesaw2Chain);
  r.plan.split_k_scores = r.plan.seesaw && mma == CustomScoreMma::kWgmmaSeesawSplitK;
  r.plan.two_chain_scores = r.plan.seesaw && mma == CustomScoreMma::kWgmmaSeesaw2Chain;
  // Shipped (kAuto): v5t on every shape class, faster than v5 on all ten benchmark shapes at page
  // sizes 1 and 64 (kernels/NOTES.md, v5 step 6). v5 and v5s by name only.
  r.plan.pair_seesaw = r.plan.wgmma_pv && (mma == CustomScoreMma::kWgmmaPairSeesaw ||
                                           mma == CustomScoreMma::kWgmmaPairSeesawStaggered ||
                                           mma == CustomScoreMma::kWgmmaPairSeesawTailMask ||
                                           mma == CustomScoreMma::kAuto);
  r.plan.staggered_scores =
      r.plan.pair_seesaw && mma == CustomScoreMma::kWgmmaPairSeesawStaggered;
  r.plan.tail_mask =
      r.plan.pair_seesaw &&
      (mma == CustomScoreMma::kWgmmaPairSeesawTailMask || mma == CustomScoreMma::kAuto);
  return r;
}

int Log2(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// Launches `kernel` (a fused kernel on Cfg's tiles) and, when the KV is split, the combine: as a
// programmatic dependent with `dependent_combine` (the fused kernel then calls LaunchDependents).
template <class Cfg>
cudaError_t LaunchPlanned(void (*kernel)(KernelParams), bool dependent_combine,
                          const VerifyProblem& p, const CustomPlan& plan, const CustomConfig& c,
                          void* workspace, cudaStream_t stream) {
  KernelParams k{};
  k.q = p.q;
  k.kv_pool = p.kv_pool;
  k.kv_indptr = p.kv_indptr;
  k.kv_indices = p.kv_indices;
  k.kv_lens = p.kv_lens;
  k.tree_mask = p.tree_mask;
  k.draft = p.shape.draft;
  k.heads = p.shape.heads;
  k.rows = p.shape.draft * p.shape.heads;
  k.page_shift = Log2(p.shape.page_size);
  k.mask_bits = p.shape.mask_format == MaskFormat::kBits ? 1 : 0;
  k.mask_row_bytes = static_cast<int>(MaskRowBytes(p.shape.mask_format, p.shape.draft));
  // An e4m3 pool's kernel reads the codes' values: kv_scale goes onto the logits and onto o.
  const bool e4m3 = p.shape.kv_dtype == KvDtype::kE4m3;
  k.scale_log2 = p.sm_scale * (e4m3 ? p.kv_scale : 1.f) * 1.4426950408889634f;
  k.o_scale = e4m3 ? p.kv_scale : 1.f;
  k.splits = plan.splits;
  k.tiles_per_split = static_cast<int>(plan.tiles_per_split);
  k.o = p.o;
  k.lse = p.lse;
  k.rows_total = int64_t{k.rows} * p.shape.batch;
  k.skip = c.skip;
  // Page ids past the pool are read as page 0 (v5): the kernel never reads outside the pool.
  k.page_limit = PageIdLimit(p.shape.num_pages);
  k.checks = c.checks;
  if (plan.splits > 1) {
    k.o_partial = static_cast<float*>(workspace);
    k.lse_partial =
        reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.partial_lse_offset);
  }
  const dim3 grid(plan.row_blocks, plan.splits, p.shape.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || plan.splits == 1) return e;
  const int64_t blocks =
      (k.rows_total + custom::kCombineRowsPerBlock - 1) / custom::kCombineRowsPerBlock;
  if (dependent_combine) {
    // A programmatic dependent of the fused kernel: it launches while the last CTAs of the
    // fused kernel run and waits (griddepcontrol.wait) for their results.
    cudaLaunchConfig_t lc{};
    lc.gridDim = dim3(static_cast<unsigned>(blocks));
    lc.blockDim = dim3(128, custom::kCombineRowsPerBlock);
    lc.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = attr;
    lc.numAttrs = 1;
    return cudaLaunchKernelEx(&lc, custom::CombineSplitsKernel, k, Cfg::kTokens);
  }
  custom::CombineSplitsKernel<<<static_cast<unsigned>(blocks),
                                dim3(128, custom::kCombineRowsPerBlock), 0, stream>>>(k,
                                                                                      Cfg::kTokens);
  return cudaGetLastError();
}

template <class Cfg, bool kWgmmaS, bool kWgmmaPV, bool kSeesaw = false, bool kSplitK = false,
          bool kTwoChainS = false, bool kE4m3 = false>
cudaError_t LaunchPlanned(const VerifyProblem& p, const CustomPlan& plan, const CustomConfig& c,
                          void* workspace, cudaStream_t stream) {
  return LaunchPlanned<Cfg>(
      custom::FusedVerifyKernel<Cfg, kWgmmaS, kWgmmaPV, kSeesaw, kSplitK, kTwoChainS, kE4m3>,
      kSeesaw, p, plan, c, workspace, stream);
}

}  // namespace

CustomConfig CustomConfigFromEnv() {
  CustomConfig c;
  const char* v = std::getenv("VERIFYD_FORCE_SM120_CONFIG");
  c.small_smem = v != nullptr && std::strcmp(v, "1") == 0;
  return c;
}

cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan,
                              CustomScoreMma mma) {
  const ResolvedPlan r = Resolve(p, c, mma);
  if (r.error == cudaSuccess) *plan = r.plan;
  return r.error;
}

bool CustomChecksInKernel(const VerifyProblem& p, const CustomConfig& c) {
  const ResolvedPlan r = Resolve(p, c, CustomScoreMma::kAuto);
  return r.error == cudaSuccess && InKernelChecks(r.plan);
}

size_t CustomWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c) {
  const ResolvedPlan r = Resolve(p, c, CustomScoreMma::kAuto);
  return r.error == cudaSuccess ? r.plan.workspace_bytes : 0;
}

cudaError_t LaunchCustom(const VerifyProblem& p, const CustomConfig& c, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  return LaunchCustomWith(p, c, CustomScoreMma::kAuto, workspace, workspace_bytes, stream);
}

cudaError_t LaunchCustomWith(const VerifyProblem& p, const CustomConfig& c, CustomScoreMma mma,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!CheckShape(p.shape).empty() || p.max_kv_len < p.shape.draft ||
      p.max_kv_len > kMaxPrefix + kMaxDraft) {
    return cudaErrorInvalidValue;
  }
  // Only v3e reads e4m3 codes, and it reads nothing else: any other pairing would read the pool
  // as the wrong type. (The engines dequantise an e4m3 pool's pages for the other schedules.)
  if ((p.shape.kv_dtype == KvDtype::kE4m3) != (mma == CustomScoreMma::kWgmmaV3E4m3) ||
      (p.shape.kv_dtype == KvDtype::kE4m3 && !(p.kv_scale > 0.f && std::isfinite(p.kv_scale)))) {
    return cudaErrorInvalidValue;
  }
  // The op's checks are made inside v5t and the combine only (a schedule chosen by kAuto or by
  // name), never beside `skip`, and always with somewhere to put the verdict.
  if (c.checks.words != nullptr &&
      ((mma != CustomScoreMma::kAuto && mma != CustomScoreMma::kWgmmaPairSeesawTailMask) ||
       c.small_smem || c.skip != nullptr || c.checks.failed == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const ResolvedPlan r = Resolve(p, c, mma);
  if (r.error != cudaSuccess) return r.error;
  if (r.plan.e4m3_loads != (mma == CustomScoreMma::kWgmmaV3E4m3)) return cudaErrorInvalidValue;
  if (c.checks.words != nullptr && !InKernelChecks(r.plan)) return cudaErrorInvalidValue;
  if (r.plan.workspace_bytes > 0 &&
      (workspace == nullptr || workspace_bytes < r.plan.workspace_bytes)) {
    return cudaErrorInvalidValue;
  }
  if (r.plan.small_tiles) {
    return LaunchPlanned<Sm120Tiles, false, false>(p, r.plan, c, workspace, stream);
  }
  if (r.plan.pair_seesaw) {
    auto* kernel = r.plan.staggered_scores ? custom::PairSeesawKernel<HopperTiles, true>
                   : r.plan.tail_mask      ? custom::PairSeesawKernel<HopperTiles, false, true>
                                           : custom::PairSeesawKernel<HopperTiles, false>;
    return LaunchPlanned<HopperTiles>(kernel, true, p, r.plan, c, workspace, stream);
  }
  if (r.plan.split_k_scores) {
    return LaunchPlanned<HopperTiles, true, true, true, true>(p, r.plan, c, workspace, stream);
  }
  if (r.plan.two_chain_scores) {
    return LaunchPlanned<HopperTiles, true, true, true, false, true>(p, r.plan, c, workspace, stream);
  }
  if (r.plan.seesaw) {
    return LaunchPlanned<HopperTiles, true, true, true>(p, r.plan, c, workspace, stream);
  }
  if (r.plan.e4m3_loads) {
    return LaunchPlanned<HopperTiles, true, true, false, false, false, true>(p, r.plan, c, workspace,
                                                                            stream);
  }
  if (r.plan.wgmma_pv) return LaunchPlanned<HopperTiles, true, true>(p, r.plan, c, workspace, stream);
  if (r.plan.wgmma_scores) {
    return LaunchPlanned<HopperTiles, true, false>(p, r.plan, c, workspace, stream);
  }
  return LaunchPlanned<HopperTiles, false, false>(p, r.plan, c, workspace, stream);
}

}  // namespace verifyd::kernels
