// The fused kernel against itself (src/probe/invariance.h), with no reference: ragged batches
// whose prefixes are not multiples of the tile (500, 1000, 4033, 16065, ...) and put draft blocks
// across tile boundaries, B and H that give splits of several tiles, every forced split count
// (one per distinct tiles-per-split, both parities), page sizes 1/16/64, a permuted pool, each
// request alone and at every position of its batch, between empty and short requests, and the
// draft block started later. Launched directly (LaunchCustomVariant), outputs poisoned before each
// launch. Skips without a GPU.

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/variants/custom_variants.h"
#include "src/bundle/random_bundle.h"
#include "src/probe/invariance.h"
#include "tests/common/gpu_test_support.h"

namespace verifyd {
namespace {

using testing::DeviceBuffer;
using testing::DeviceBundle;

struct KernelChoice {
  std::string name;
  kernels::CustomConfig config;
  kernels::CustomSchedule schedule = kernels::CustomSchedule::kAuto;
  int tile_tokens = 64;
};

// The shipped kernel (v5t on Hopper), the v4 seesaw and the sm_120-sized tiles (16-token tiles).
std::vector<KernelChoice> Choices() {
  std::vector<KernelChoice> v(3);
  v[0].name = "shipped";
  v[1].name = "v4";
  v[1].schedule = kernels::CustomSchedule::kV4;
  v[2].name = "sm120";
  v[2].config.small_smem = true;
  v[2].tile_tokens = 16;
  return v;
}

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

// The kernel as a CustomRunner: load uploads, run poisons the outputs, launches and copies back.
struct KernelRunner {
  KernelChoice choice;
  std::unique_ptr<DeviceBundle> dev;
  BundleView view;
  int launches = 0;
  CustomRunner Runner() {
    CustomRunner r;
    r.tile_tokens = choice.tile_tokens;
    r.load = [this](const BundleView& v) {
      view = v;
      dev = std::make_unique<DeviceBundle>();
      return CudaStatus(dev->Upload(v), "upload");
    };
    r.run = [this](int splits, PathOutput* out) -> absl::Status {
      kernels::CustomConfig c = choice.config;
      c.force_splits = splits;
      const size_t ws_bytes =
          kernels::CustomVariantWorkspaceBytes(dev->problem, c, choice.schedule);
      DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
      if (absl::Status st = CudaStatus(dev->Poison(), "poison"); !st.ok()) return st;
      ++launches;
      absl::Status st = CudaStatus(kernels::LaunchCustomVariant(dev->problem, c, choice.schedule,
                                                                ws.get<void>(), ws_bytes, nullptr),
                                   "launch");
      if (st.ok()) st = CudaStatus(cudaDeviceSynchronize(), "kernel");
      out->o.resize(view.o_elems());
      out->lse.resize(view.lse_elems());
      if (st.ok()) {
        st = CudaStatus(cudaMemcpy(out->o.data(), dev->o.get<void>(), out->o.size() * 2,
                                   cudaMemcpyDeviceToHost),
                        "copy o");
      }
      if (st.ok()) {
        st = CudaStatus(cudaMemcpy(out->lse.data(), dev->lse.get<void>(), out->lse.size() * 4,
                                   cudaMemcpyDeviceToHost),
                        "copy lse");
      }
      if (st.ok() && !(dev->o.GuardIntact() && dev->lse.GuardIntact() && ws.GuardIntact())) {
        st = absl::InternalError("a write past the end of o, lse or the workspace");
      }
      return st;
    };
    return r;
  }
};

// The probe suite's cases (kernels::kMaxPrefix-sized) and the wide batch of the traffic:
// B = 32, H = 16, T = 4, each request its own prefix.
std::vector<InvarianceCase> Cases() {
  std::vector<InvarianceCase> v = InvarianceCases(65536, 64);
  InvarianceCase wide;
  wide.name = "wide";
  wide.spec.draft = 4;
  wide.spec.heads = 16;
  wide.spec.page_size = 1;
  wide.spec.tree = TreeKind::kRandomTree;
  wide.spec.seed = 0x3216;
  const int64_t prefixes[] = {500, 1000, 4033, 16065, 2045, 37, 0, 130};
  for (int b = 0; b < 32; ++b) wide.spec.prefix_lens.push_back(prefixes[b % 8] + b / 8);
  wide.spec.batch = 32;
  v.push_back(wide);
  return v;
}

class CustomInvarianceTest
    : public ::testing::TestWithParam<std::tuple<InvarianceCase, KernelChoice>> {
 protected:
  void SetUp() override {
    const std::string why = testing::NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  }
};

TEST_P(CustomInvarianceTest, OutputDoesNotDependOnHowItIsComputed) {
  const auto& [c, choice] = GetParam();
  KernelRunner k{choice, nullptr, {}, 0};
  const CustomRunner runner = k.Runner();
  for (const InvarianceResult& r : RunInvarianceChecks(runner, c, InvarianceSweep::kFull)) {
    std::printf(
        "[ invariance ] kernel=%s check=%s passed=%d runs=%d rows=%lld max_row_rel_l2=%.3g "
        "max_lse_abs=%.3g bit_identical=%d seconds=%.3f%s%s\n",
        choice.name.c_str(), r.name.c_str(), r.passed ? 1 : 0, r.runs,
        static_cast<long long>(r.agreement.rows), r.agreement.max_row_rel_l2,
        r.agreement.max_lse_abs, r.agreement.exact() ? 1 : 0, r.seconds, r.passed ? "" : " ",
        r.reason.c_str());
    EXPECT_TRUE(r.passed) << r.name << ": " << r.reason;
    EXPECT_GT(r.agreement.rows, 0) << r.name;
    if (r.name.ends_with("page_size") || r.name.ends_with("page_order")) {
      EXPECT_TRUE(r.agreement.exact()) << r.name << ": the plan is the same, so are the bits";
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<InvarianceCase, KernelChoice>>& i) {
  return std::get<0>(i.param).name + "__" + std::get<1>(i.param).name;
}

INSTANTIATE_TEST_SUITE_P(Geometry, CustomInvarianceTest,
                         ::testing::Combine(::testing::ValuesIn(Cases()),
                                            ::testing::ValuesIn(Choices())),
                         ParamName);

// The fast subset (the periodic probe's) catches a split-plan dependence on its own: the sweep
// holds counts of both tiles-per-split parities for each case.
TEST(CustomInvarianceFast, SweepHoldsBothParitiesForEveryCase) {
  for (const InvarianceCase& c : Cases()) {
    RandomBundle b(c.spec);
    const int64_t tiles = (b.view().max_kv_len + 63) / 64;
    bool even = false, odd = false;
    for (int s : InvarianceSplitCounts(tiles, InvarianceSweep::kFast)) {
      const int64_t tps = s > 0 ? (tiles + s - 1) / s : 0;
      even |= tps > 1 && tps % 2 == 0;
      odd |= tps > 1 && tps % 2 == 1;
    }
    EXPECT_TRUE(even && odd) << c.name << " (" << tiles << " tiles)";
  }
}

}  // namespace
}  // namespace verifyd
