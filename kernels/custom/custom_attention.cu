#include "kernels/custom/custom_attention.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "kernels/custom/custom_launch.h"
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

// The shipped kernels: one schedule per architecture and pool type (custom_schedule.h).
constexpr custom::KernelFn kV5tKernel = custom::PairSeesawKernel<HopperTiles, false, true>;
constexpr custom::KernelFn kV3eKernel =
    custom::FusedVerifyKernel<HopperTiles, true, true, false, false, false, true>;
constexpr custom::KernelFn kSmallTilesKernel = custom::FusedVerifyKernel<Sm120Tiles, false, false>;

// What a launch needs to know about a device, read once per device: the shipped kernels are
// prepared (PrepareKernel) at the same time.
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
  if (f->hopper_tiles_fit && f->wgmma) {
    for (custom::KernelFn k : {kV5tKernel, kV3eKernel}) {
      e = custom::PrepareKernel(k, HopperTileShape());
      if (e != cudaSuccess) return e;
    }
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &f->ctas_hopper, kV5tKernel, HopperTiles::kThreads, HopperTiles::kSmemBytes);
    if (e != cudaSuccess) return e;
  }
  e = custom::PrepareKernel(kSmallTilesKernel, Sm120TileShape());
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &f->ctas_sm120, kSmallTilesKernel, Sm120Tiles::kThreads, Sm120Tiles::kSmemBytes);
}

cudaError_t CurrentDevice(int* dev) {
  cudaError_t e = cudaGetDevice(dev);
  if (e != cudaSuccess) return e;
  return *dev < 0 || *dev >= kMaxDevices ? cudaErrorInvalidDevice : cudaSuccess;
}

cudaError_t CurrentDeviceFacts(DeviceFacts* out) {
  static std::mutex mu;
  static std::array<DeviceFacts, kMaxDevices> facts;
  int dev = 0;
  if (cudaError_t e = CurrentDevice(&dev); e != cudaSuccess) return e;
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

ResolvedPlan Resolve(const VerifyProblem& p, const CustomConfig& c, CustomSchedule schedule) {
  ResolvedPlan r;
  DeviceFacts f;
  r.error = CurrentDeviceFacts(&f);
  if (r.error != cudaSuccess) return r;
  const bool e4m3 = p.shape.kv_dtype == KvDtype::kE4m3;
  const bool hopper = !c.small_smem && f.hopper_tiles_fit && f.wgmma;
  if (schedule == CustomSchedule::kAuto) {
    schedule = !hopper ? CustomSchedule::kSmallTiles
               : e4m3  ? CustomSchedule::kV3e
                       : CustomSchedule::kV5t;
  }
  const bool small = schedule == CustomSchedule::kSmallTiles;
  if (!small && !hopper) {
    r.error = cudaErrorNotSupported;  // the Hopper tiles' schedules run on sm_90 only
    return r;
  }
  if (e4m3 != ScheduleReadsE4m3(schedule)) {
    // An e4m3 pool where v3e does not run is the engines' to dequantise.
    r.error = e4m3 && small ? cudaErrorNotSupported : cudaErrorInvalidValue;
    return r;
  }
  const int ctas = small ? f.ctas_sm120 : f.ctas_hopper;
  if (ctas < 1) {
    r.error = cudaErrorInvalidConfiguration;
    return r;
  }
  r.plan = PlanCustom(p, small, c.num_sms > 0 ? c.num_sms : f.sms, ctas, c.force_splits);
  r.plan.schedule = schedule;
  return r;
}

int Log2(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

namespace custom {

bool ProblemRefused(const VerifyProblem& p) {
  return !CheckShape(p.shape).empty() || p.max_kv_len < p.shape.draft ||
         p.max_kv_len > kMaxPrefix + kMaxDraft ||
         (p.shape.kv_dtype == KvDtype::kE4m3 && !(p.kv_scale > 0.f && std::isfinite(p.kv_scale))) ||
         !(p.o_scale > 0.f && std::isfinite(p.o_scale));
}

bool WorkspaceShort(const CustomPlan& plan, const void* workspace, size_t workspace_bytes) {
  return plan.workspace_bytes > 0 &&
         (workspace == nullptr || workspace_bytes < plan.workspace_bytes);
}

cudaError_t PrepareKernel(KernelFn kernel, const CustomTileShape& tiles) {
  static std::mutex mu;
  static std::set<std::pair<KernelFn, int>> prepared;
  int dev = 0;
  if (cudaError_t e = CurrentDevice(&dev); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (prepared.count({kernel, dev}) != 0) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(tiles.smem_bytes));
  if (e == cudaSuccess) prepared.insert({kernel, dev});
  return e;
}

cudaError_t LaunchPlanned(KernelFn kernel, bool dependent_combine, const VerifyProblem& p,
                          const CustomPlan& plan, const CustomConfig& c, void* workspace,
                          cudaStream_t stream) {
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
  // An e4m3 pool's kernel reads the codes' values: kv_scale goes onto the logits and onto o
  // (a dequantised pool's is already on sm_scale, and comes as o_scale).
  const bool e4m3 = p.shape.kv_dtype == KvDtype::kE4m3;
  k.scale_log2 = p.sm_scale * (e4m3 ? p.kv_scale : 1.f) * 1.4426950408889634f;
  k.o_scale = (e4m3 ? p.kv_scale : 1.f) * p.o_scale;
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
  kernel<<<grid, plan.tiles.threads, plan.tiles.smem_bytes, stream>>>(k);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || plan.splits == 1) return e;
  const int64_t blocks = (k.rows_total + kCombineRowsPerBlock - 1) / kCombineRowsPerBlock;
  if (dependent_combine) {
    // A programmatic dependent of the fused kernel: it launches while the last CTAs of the
    // fused kernel run and waits (griddepcontrol.wait) for their results.
    cudaLaunchConfig_t lc{};
    lc.gridDim = dim3(static_cast<unsigned>(blocks));
    lc.blockDim = dim3(128, kCombineRowsPerBlock);
    lc.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = attr;
    lc.numAttrs = 1;
    return cudaLaunchKernelEx(&lc, CombineSplitsKernel, k, plan.tiles.tokens);
  }
  CombineSplitsKernel<<<static_cast<unsigned>(blocks), dim3(128, kCombineRowsPerBlock), 0,
                        stream>>>(k, plan.tiles.tokens);
  return cudaGetLastError();
}

}  // namespace custom

CustomConfig CustomConfigFromEnv() {
  CustomConfig c;
  const char* v = std::getenv("VERIFYD_FORCE_SM120_CONFIG");
  c.small_smem = v != nullptr && std::strcmp(v, "1") == 0;
  return c;
}

cudaError_t ResolveCustomPlan(const VerifyProblem& p, const CustomConfig& c, CustomPlan* plan,
                              CustomSchedule schedule) {
  const ResolvedPlan r = Resolve(p, c, schedule);
  if (r.error == cudaSuccess) *plan = r.plan;
  return r.error;
}

bool CustomChecksInKernel(const VerifyProblem& p, const CustomConfig& c) {
  const ResolvedPlan r = Resolve(p, c, CustomSchedule::kAuto);
  return r.error == cudaSuccess && ScheduleChecksInKernel(r.plan.schedule);
}

size_t CustomWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c) {
  const ResolvedPlan r = Resolve(p, c, CustomSchedule::kAuto);
  return r.error == cudaSuccess ? r.plan.workspace_bytes : 0;
}

cudaError_t LaunchCustom(const VerifyProblem& p, const CustomConfig& c, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  return LaunchCustomWith(p, c, CustomSchedule::kAuto, workspace, workspace_bytes, stream);
}

cudaError_t LaunchCustomWith(const VerifyProblem& p, const CustomConfig& c, CustomSchedule schedule,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!ScheduleShipped(schedule)) return cudaErrorNotSupported;
  if (custom::ProblemRefused(p)) return cudaErrorInvalidValue;
  // Only v3e reads e4m3 codes, and it reads nothing else: any other pairing would read the pool
  // as the wrong type. (The engines dequantise an e4m3 pool's pages for the other schedules.)
  if (schedule != CustomSchedule::kAuto &&
      (p.shape.kv_dtype == KvDtype::kE4m3) != ScheduleReadsE4m3(schedule)) {
    return cudaErrorInvalidValue;
  }
  // The op's checks are made inside v5t and the combine only (chosen by kAuto or by name), never
  // beside `skip`, and always with somewhere to put the verdict.
  if (c.checks.words != nullptr &&
      ((schedule != CustomSchedule::kAuto && !ScheduleChecksInKernel(schedule)) || c.small_smem ||
       c.skip != nullptr || c.checks.failed == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const ResolvedPlan r = Resolve(p, c, schedule);
  if (r.error != cudaSuccess) return r.error;
  if (c.checks.words != nullptr && !ScheduleChecksInKernel(r.plan.schedule)) {
    return cudaErrorInvalidValue;
  }
  if (custom::WorkspaceShort(r.plan, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  switch (r.plan.schedule) {
    case CustomSchedule::kV5t:
      return custom::LaunchPlanned(kV5tKernel, true, p, r.plan, c, workspace, stream);
    case CustomSchedule::kV3e:
      return custom::LaunchPlanned(kV3eKernel, false, p, r.plan, c, workspace, stream);
    case CustomSchedule::kSmallTiles:
      return custom::LaunchPlanned(kSmallTilesKernel, false, p, r.plan, c, workspace, stream);
    default:
      return cudaErrorNotSupported;
  }
}

}  // namespace verifyd::kernels
