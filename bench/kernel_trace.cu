// verifyd-kernel-trace: where the shipped kernel (v5, pair_seesaw_kernel.cuh) spends the cycles of
// a step. This translation unit compiles its own copy of the kernels with VERIFYD_KERNEL_TRACE, so
// that CTA (0, 0, 0) writes clock64() at each phase boundary of both warpgroups; it launches one
// benchmark shape a few times and prints, per event, the median over the steady-state steps of
// the cycles since the step began (warpgroup 0's step start), and the median step length.
// A diagnostic, not a benchmark: the stamps cost a few cycles each.
//
//   verifyd-kernel-trace [B T H prefix page [v5|v5s|v5t]]   (default 4 16 64 8192 64, the
//                                                          shipped kernel)

#define VERIFYD_KERNEL_TRACE 1
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/custom/custom_attention.cu"          // NOLINT: the kernels, with the trace stamps
#include "kernels/custom/variants/custom_variants.cu"  // NOLINT: v5 and v5s, likewise
#include "src/bundle/random_bundle.h"
#include "tests/common/device_bundle.h"

namespace {

using verifyd::kernels::custom::kTraceEvents;
using verifyd::kernels::custom::kTraceSteps;

const char* const kEvents[2][kTraceEvents] = {
    {"step start", "buf0 lower blocks landed", "buf0 upper blocks landed", "S0 done",
     "m0 published", "P0 V0_L issued", "m1 received", "P0 published", "P0 V0_L done, reload",
     "P1 received", "P1 V1_L done", "buf1 reload issued, step end"},
    {"step start", "buf1 upper blocks landed", "buf1 lower blocks landed", "S1 done", "m0 received",
     "m1 published", "P1 published", "P1 V1_R issued", "P0 received", "P1 V1_R done, reload",
     "P0 V0_R done", "buf0 reload issued, step end"}};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Fail(const char* what, cudaError_t e) {
  std::fprintf(stderr, "verifyd-kernel-trace: %s: %s\n", what, cudaGetErrorString(e));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace verifyd;
  RandomBundleSpec spec;
  spec.batch = 4;
  spec.draft = 16;
  spec.heads = 64;
  spec.prefix = 8192;
  spec.page_size = 64;
  kernels::CustomSchedule schedule = kernels::CustomSchedule::kAuto;
  if (argc == 7) {
    const std::string v = argv[6];
    if (v == "v5") {
      schedule = kernels::CustomSchedule::kV5;
    } else if (v == "v5s") {
      schedule = kernels::CustomSchedule::kV5s;
    } else if (v == "v5t") {
      schedule = kernels::CustomSchedule::kV5t;
    } else {
      std::fprintf(stderr, "verifyd-kernel-trace: unknown variant %s\n", argv[6]);
      return 2;
    }
  }
  if (argc == 6 || argc == 7) {
    spec.batch = std::atoi(argv[1]);
    spec.draft = std::atoi(argv[2]);
    spec.heads = std::atoi(argv[3]);
    spec.prefix = std::atoll(argv[4]);
    spec.page_size = std::atoi(argv[5]);
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: verifyd-kernel-trace [B T H prefix page [v5|v5s|v5t]]\n");
    return 2;
  }
  spec.seed = 7;
  RandomBundle bundle(spec);
  testing::DeviceBundle dev;
  if (cudaError_t e = dev.Upload(bundle.view()); e != cudaSuccess) return Fail("upload", e);
  kernels::CustomConfig config;
  kernels::CustomPlan plan;
  if (cudaError_t e = kernels::ResolveCustomPlan(dev.problem, config, &plan, schedule);
      e != cudaSuccess) {
    return Fail("plan", e);
  }
  if (plan.schedule != kernels::CustomSchedule::kV5 &&
      plan.schedule != kernels::CustomSchedule::kV5s &&
      plan.schedule != kernels::CustomSchedule::kV5t) {
    std::fprintf(stderr, "verifyd-kernel-trace: the plan is not v5 on this device\n");
    return 1;
  }
  const size_t n = size_t{2} * kTraceSteps * kTraceEvents;
  testing::DeviceBuffer trace(n * sizeof(uint64_t));
  uint64_t* trace_ptr = trace.get<uint64_t>();
  if (cudaError_t e =
          cudaMemcpyToSymbol(kernels::custom::g_kernel_trace, &trace_ptr, sizeof(trace_ptr));
      e != cudaSuccess) {
    return Fail("trace symbol", e);
  }
  const size_t ws_bytes = plan.workspace_bytes;
  testing::DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  std::vector<uint64_t> stamps(n);
  // [warpgroup][event] -> cycles since warpgroup 0's step start, over steady-state steps.
  std::vector<double> rel[2][kTraceEvents];
  std::vector<double> step_len;
  const int64_t tiles = plan.tiles_per_split;
  const int steps = static_cast<int>(std::min<int64_t>((tiles + 1) / 2, kTraceSteps));
  for (int launch = 0; launch < 6; ++launch) {
    cudaMemset(trace.get<void>(), 0, n * sizeof(uint64_t));
    if (cudaError_t e = kernels::LaunchCustomVariant(dev.problem, config, schedule, ws.get<void>(),
                                                     ws_bytes, nullptr);
        e != cudaSuccess) {
      return Fail("launch", e);
    }
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return Fail("kernel", e);
    if (launch < 2) continue;  // warm-up
    cudaMemcpy(stamps.data(), trace.get<void>(), n * sizeof(uint64_t), cudaMemcpyDeviceToHost);
    auto at = [&](int wg, int step, int ev) {
      return stamps[(size_t(wg) * kTraceSteps + step) * kTraceEvents + ev];
    };
    // Steady state: skip the first two steps and the last one.
    for (int step = 2; step + 1 < steps; ++step) {
      const double t0 = static_cast<double>(at(0, step, 0));
      step_len.push_back(static_cast<double>(at(0, step + 1, 0)) - t0);
      for (int wg = 0; wg < 2; ++wg) {
        for (int ev = 0; ev < kTraceEvents; ++ev) {
          if (at(wg, step, ev) == 0) continue;
          rel[wg][ev].push_back(static_cast<double>(at(wg, step, ev)) - t0);
        }
      }
    }
  }
  std::printf(
      "shape B=%d T=%d H=%d prefix=%lld page=%d: %d CTAs (%d KV splits), %lld tiles "
      "per CTA, %d steps; CTA (0,0,0), %zu steady-state steps over 4 launches\n",
      spec.batch, spec.draft, spec.heads, static_cast<long long>(spec.prefix), spec.page_size,
      plan.row_blocks * spec.batch * plan.splits, plan.splits, static_cast<long long>(tiles), steps,
      step_len.size());
  std::printf("median step: %.0f cycles (%.0f per tile)\n", Median(step_len), Median(step_len) / 2);
  std::printf("| warpgroup | event | cycles since the step began (median) |\n|---|---|---:|\n");
  for (int wg = 0; wg < 2; ++wg) {
    for (int ev = 0; ev < kTraceEvents; ++ev) {
      std::printf("| %d | %s | %.0f |\n", wg, kEvents[wg][ev], Median(rel[wg][ev]));
    }
  }
  return 0;
}
