// The fused kernel (LaunchCustom) against the fp64 oracle on random bundles, for each tile
// configuration (Hopper-sized, sm_120-sized forced on any GPU) with the split chosen by the
// planner and with a forced split. Outputs are poisoned before each launch (every element must
// be written) and guarded by sentinel bytes; the pools hold NaN outside the requests' tokens.
// Skips without a GPU.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/variants/custom_variants.h"
#include "src/bundle/random_bundle.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_oracle.h"
#include "tests/common/gpu_test_support.h"

namespace verifyd {
namespace {

using kernels::CustomConfig;
using kernels::MaskFormat;
using testing::DeviceBuffer;
using testing::DeviceBundle;

struct KernelCase {
  std::string name;
  RandomBundleSpec spec;
};

struct KernelConfig {
  std::string name;
  CustomConfig config;
  kernels::CustomSchedule schedule = kernels::CustomSchedule::kAuto;
};

// Oracle work per case, in (query row x key) pairs: larger cases check a sample of draft tokens
// (all heads of each), always including the first, middle and last token.
constexpr int64_t kOracleBudget = int64_t{1} << 20;

std::string CaseName(const RandomBundleSpec& s, const char* extra = "") {
  std::string n = "B" + std::to_string(s.batch) + "_T" + std::to_string(s.draft) + "_H" +
                  std::to_string(s.heads) + "_P" + std::to_string(s.page_size) + "_pre";
  n += s.prefix_lens.empty() ? std::to_string(s.prefix) : "mixed";
  n += s.tree == TreeKind::kChain ? "_chain" : "_tree";
  n += s.mask_format == MaskFormat::kBits ? "_bits" : "_bytes";
  return n + extra;
}

KernelCase MakeCase(int batch, int draft, int heads, int page, int64_t prefix, TreeKind tree,
                    MaskFormat fmt, uint64_t seed, const char* extra = "") {
  KernelCase c;
  c.spec.batch = batch;
  c.spec.draft = draft;
  c.spec.heads = heads;
  c.spec.page_size = page;
  c.spec.prefix = prefix;
  c.spec.tree = tree;
  c.spec.mask_format = fmt;
  c.spec.seed = seed;
  c.name = CaseName(c.spec, extra) + "_s" + std::to_string(seed);
  return c;
}

// A few quick cases: the compute-sanitizer run uses these.
std::vector<KernelCase> SmallCases() {
  std::vector<KernelCase> v;
  v.push_back(MakeCase(1, 3, 8, 16, 54, TreeKind::kRandomTree, MaskFormat::kBytes, 11));
  v.push_back(MakeCase(1, 17, 1, 1, 97, TreeKind::kChain, MaskFormat::kBits, 12));
  KernelCase e =
      MakeCase(2, 8, 16, 64, 0, TreeKind::kRandomTree, MaskFormat::kBytes, 13, "_emptyrow");
  e.spec.empty_row = true;
  v.push_back(e);
  KernelCase m = MakeCase(3, 2, 8, 1, 0, TreeKind::kRandomTree, MaskFormat::kBits, 14);
  m.spec.prefix_lens = {0, 97, 300};
  m.name = CaseName(m.spec) + "_s14";
  v.push_back(m);
  v.push_back(MakeCase(1, 1, 8, 64, 200, TreeKind::kChain, MaskFormat::kBytes, 15));
  return v;
}

// The kernel grid, as a covering design: every T with every H, every prefix with every page
// size, chains and random trees, both mask formats, fully masked rows, mixed prefixes in a batch.
std::vector<KernelCase> GridCases() {
  const int drafts[] = {1, 2, 3, 8, 16, 17, 64, 128, 1024};
  const int heads[] = {1, 8, 16, 64, 128};
  const int pages[] = {1, 16, 64};
  const int64_t prefixes[] = {0, 1, 54, 97, 4096, 32768};
  std::vector<KernelCase> v;
  uint64_t seed = 100;
  int k = 0;
  for (int t : drafts) {
    for (int h : heads) {
      // Bound the kernel's work (rows x keys) so the largest cases stay ~1 s on the host.
      int pi = k % 6;
      while (pi > 0 && int64_t{t} * h * (prefixes[pi] + t) > (int64_t{1} << 28)) --pi;
      const int batch = int64_t{t} * h <= 128 ? 2 : 1;
      v.push_back(MakeCase(batch, t, h, pages[k % 3], prefixes[pi],
                           k % 2 ? TreeKind::kChain : TreeKind::kRandomTree,
                           (k / 2) % 2 ? MaskFormat::kBits : MaskFormat::kBytes, seed++));
      ++k;
    }
  }
  for (int64_t pre : prefixes) {
    for (int page : pages) {
      v.push_back(MakeCase(2, 16, 8, page, pre, TreeKind::kRandomTree,
                           page == 16 ? MaskFormat::kBits : MaskFormat::kBytes, seed++));
      v.push_back(MakeCase(1, 3, 64, page, pre, TreeKind::kChain, MaskFormat::kBytes, seed++));
    }
  }
  for (int page : {2, 4, 8, 32, 128}) {
    v.push_back(MakeCase(2, 8, 8, page, 1000, TreeKind::kRandomTree, MaskFormat::kBytes, seed++));
  }
  for (auto [t, h] : {std::pair{1, 8}, std::pair{17, 8}, std::pair{64, 16}, std::pair{128, 1}}) {
    KernelCase e =
        MakeCase(2, t, h, 16, 97, TreeKind::kRandomTree, MaskFormat::kBits, seed++, "_emptyrow");
    e.spec.empty_row = true;
    v.push_back(e);
  }
  KernelCase mixed = MakeCase(8, 16, 8, 16, 0, TreeKind::kRandomTree, MaskFormat::kBytes, seed++);
  mixed.spec.prefix_lens = {0, 1, 54, 97, 4096, 32768, 3, 640};
  mixed.name = CaseName(mixed.spec) + "_s" + std::to_string(mixed.spec.seed);
  v.push_back(mixed);
  KernelCase mixed1 = MakeCase(5, 3, 64, 1, 0, TreeKind::kChain, MaskFormat::kBits, seed++);
  mixed1.spec.prefix_lens = {4096, 0, 97, 1, 2000};
  mixed1.name = CaseName(mixed1.spec) + "_s" + std::to_string(mixed1.spec.seed);
  v.push_back(mixed1);
  KernelCase big_logits =
      MakeCase(2, 16, 16, 64, 4096, TreeKind::kRandomTree, MaskFormat::kBytes, seed++, "_qx8");
  big_logits.spec.q_scale = 8.f;
  v.push_back(big_logits);
  v.push_back(MakeCase(1, 1024, 8, 64, 32768, TreeKind::kRandomTree, MaskFormat::kBits, seed++));
  v.push_back(MakeCase(16, 8, 16, 1, 2048, TreeKind::kRandomTree, MaskFormat::kBytes, seed++));
  return v;
}

// hopper, hopper_split5: as shipped (v5t on an sm_90 device); the others by name, the bench-only
// ones from kernels/custom/variants, each skipped where it does not run: hopper_v4,
// hopper_v4_split5: the seesaw schedule; hopper_v4k: with split-K Q·Kᵀ; hopper_v4c: with Q·Kᵀ in
// two accumulator chains; hopper_v5, hopper_v5_split5: the seesaw over pairs of tiles (odd tile
// counts per split included); hopper_v5s: v5 with the two warpgroups' Q·Kᵀ in turn; hopper_v5t,
// hopper_v5t_split5: v5 with the tree mask compiled only into the steps from the first tile that
// reaches the draft keys (splits that start inside the draft keys included); hopper_v3: the v3
// schedule by name; hopper_qkwgmma: wgmma Q·Kᵀ, mma.sync P·V; hopper_mma: mma.sync for both;
// sm120*: the small tiles that fit sm_120, forced on whatever GPU runs the test.
std::vector<KernelConfig> Configs() {
  std::vector<KernelConfig> v(16);
  v[0].name = "hopper";
  v[1].name = "hopper_split5";
  v[1].config.force_splits = 5;
  v[2].name = "hopper_qkwgmma";
  v[2].schedule = kernels::CustomSchedule::kWgmmaScores;
  v[3].name = "hopper_mma";
  v[3].schedule = kernels::CustomSchedule::kMmaSync;
  v[4].name = "sm120";
  v[4].config.small_smem = true;
  v[5].name = "sm120_split3";
  v[5].config.small_smem = true;
  v[5].config.force_splits = 3;
  v[6].name = "hopper_v4";
  v[6].schedule = kernels::CustomSchedule::kV4;
  v[7].name = "hopper_v4_split5";
  v[7].schedule = kernels::CustomSchedule::kV4;
  v[7].config.force_splits = 5;
  v[8].name = "hopper_v3";
  v[8].schedule = kernels::CustomSchedule::kV3;
  v[9].name = "hopper_v4k";
  v[9].schedule = kernels::CustomSchedule::kV4SplitK;
  v[10].name = "hopper_v4c";
  v[10].schedule = kernels::CustomSchedule::kV4TwoChain;
  v[11].name = "hopper_v5";
  v[11].schedule = kernels::CustomSchedule::kV5;
  v[12].name = "hopper_v5_split5";
  v[12].schedule = kernels::CustomSchedule::kV5;
  v[12].config.force_splits = 5;
  v[13].name = "hopper_v5s";
  v[13].schedule = kernels::CustomSchedule::kV5s;
  v[14].name = "hopper_v5t";
  v[14].schedule = kernels::CustomSchedule::kV5t;
  v[15].name = "hopper_v5t_split5";
  v[15].schedule = kernels::CustomSchedule::kV5t;
  v[15].config.force_splits = 5;
  return v;
}

// Whether the configuration's schedule runs on this device (the Hopper tiles' need sm_90).
bool RunsHere(const KernelConfig& k, const kernels::VerifyProblem& p) {
  kernels::CustomPlan plan;
  return kernels::ResolveCustomPlan(p, k.config, &plan, k.schedule) != cudaErrorNotSupported;
}

// One case's bundle on host and device, and the oracle on its checked tokens.
struct CaseData {
  std::string name;
  std::unique_ptr<RandomBundle> bundle;
  DeviceBundle dev;
  std::vector<std::pair<int, int>> tokens;  // (request, draft token) pairs checked
  std::vector<float> ref_o;                 // [tokens, H, 512] oracle rounded to bf16
  std::vector<float> ref_lse;               // [tokens, H]
};

std::vector<std::pair<int, int>> PickTokens(const BundleView& v, uint64_t seed) {
  const int B = v.shape.batch, T = v.shape.draft, H = v.shape.heads;
  std::vector<std::pair<int, int>> all;
  int64_t work_all = 0;
  for (int b = 0; b < B; ++b) work_all += int64_t{T} * H * v.kv_lens[b];
  if (work_all <= kOracleBudget) {
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < T; ++i) all.emplace_back(b, i);
    return all;
  }
  std::vector<std::pair<int, int>> picked;
  std::mt19937_64 rng(seed);
  int64_t work = 0;
  auto add = [&](int b, int i) {
    if (std::find(picked.begin(), picked.end(), std::pair{b, i}) != picked.end()) return;
    picked.emplace_back(b, i);
    work += int64_t{H} * v.kv_lens[b];
  };
  for (int b = 0; b < B; ++b) {
    add(b, 0);
    add(b, T - 1);
    add(b, T / 2);
  }
  while (work < kOracleBudget && static_cast<int64_t>(picked.size()) < int64_t{B} * T) {
    add(static_cast<int>(rng() % B), static_cast<int>(rng() % T));
  }
  return picked;
}

CaseData* LoadCase(const KernelCase& c) {
  static std::unique_ptr<CaseData> cached;
  if (cached && cached->name == c.name) return cached.get();
  cached.reset();
  auto d = std::make_unique<CaseData>();
  d->name = c.name;
  std::printf("[ case     ] %s seed=%llu\n", c.name.c_str(),
              static_cast<unsigned long long>(c.spec.seed));
  d->bundle = std::make_unique<RandomBundle>(c.spec);
  const BundleView& v = d->bundle->view();
  if (d->dev.Upload(v) != cudaSuccess) return nullptr;
  d->tokens = PickTokens(v, c.spec.seed);
  const int H = v.shape.heads;
  const size_t n = d->tokens.size();
  std::vector<double> o(n * H * kernels::kHeadDimV), lse(n * H);
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (size_t k = next++; k < n; k = next++) {
        OracleTokenHeads(v, d->tokens[k].first, d->tokens[k].second, 0, H,
                         o.data() + k * H * kernels::kHeadDimV, lse.data() + k * H);
      }
    });
  }
  for (auto& t : pool) t.join();
  d->ref_o.resize(o.size());
  for (size_t k = 0; k < o.size(); ++k) d->ref_o[k] = RoundToBf16(static_cast<float>(o[k]));
  d->ref_lse.assign(lse.begin(), lse.end());
  cached = std::move(d);
  return cached.get();
}

class CustomKernelTest : public ::testing::TestWithParam<std::tuple<KernelCase, KernelConfig>> {
 protected:
  void SetUp() override {
    const std::string why = testing::NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  }
};

TEST_P(CustomKernelTest, MatchesOracle) {
  const auto& [kc, cfg] = GetParam();
  CaseData* d = LoadCase(kc);
  ASSERT_NE(d, nullptr) << "upload failed";
  const BundleView& v = d->bundle->view();
  ASSERT_EQ(d->dev.Poison(), cudaSuccess);

  kernels::CustomPlan plan;
  const cudaError_t planned =
      kernels::ResolveCustomPlan(d->dev.problem, cfg.config, &plan, cfg.schedule);
  if (planned == cudaErrorNotSupported) GTEST_SKIP() << cfg.name << " does not run on this device";
  ASSERT_EQ(planned, cudaSuccess);
  const size_t ws_bytes = plan.workspace_bytes;
  DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  ASSERT_EQ(ws.Fill(0xFF), cudaSuccess);
  ASSERT_EQ(kernels::LaunchCustomVariant(d->dev.problem, cfg.config, cfg.schedule, ws.get<void>(),
                                         ws_bytes, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint16_t> o(v.o_elems());
  std::vector<float> lse(v.lse_elems());
  ASSERT_EQ(cudaMemcpy(o.data(), d->dev.o.get<void>(), o.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse.data(), d->dev.lse.get<void>(), lse.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_TRUE(d->dev.o.GuardIntact()) << "write past the end of o";
  EXPECT_TRUE(d->dev.lse.GuardIntact()) << "write past the end of lse";
  EXPECT_TRUE(ws.GuardIntact()) << "write past the end of the workspace";

  // NaN first, over the whole output: the poison (NaN) survives wherever nothing was written.
  int64_t nan_o = 0, nan_lse = 0;
  for (uint16_t x : o) nan_o += std::isnan(Bf16ToFloat(x));
  for (float x : lse) nan_lse += std::isnan(x);
  ASSERT_EQ(nan_o, 0) << "unwritten or NaN output elements";
  ASSERT_EQ(nan_lse, 0) << "unwritten or NaN lse elements";

  const int H = v.shape.heads, T = v.shape.draft;
  const size_t row = size_t{kernels::kHeadDimV};
  std::vector<uint16_t> test_o(d->ref_o.size());
  std::vector<float> test_lse(d->ref_lse.size());
  for (size_t k = 0; k < d->tokens.size(); ++k) {
    const int64_t r0 = (int64_t{d->tokens[k].first} * T + d->tokens[k].second) * H;
    std::copy_n(o.begin() + r0 * row, H * row, test_o.begin() + k * H * row);
    std::copy_n(lse.begin() + r0, H, test_lse.begin() + k * H);
  }
  Tolerance tol;
  const DiffStats ds = CompareBf16ToF32(
      test_o.data(), d->ref_o.data(), static_cast<int64_t>(test_o.size()), test_lse.data(),
      d->ref_lse.data(), static_cast<int64_t>(test_lse.size()), tol);
  std::printf(
      "[ metrics  ] config=%s case=%s rows_checked=%zu rel_l2=%.3e max_abs=%.3e "
      "lse_max_abs=%.3e splits=%d schedule=%s workspace=%zu\n",
      cfg.name.c_str(), kc.name.c_str(), d->tokens.size() * H, ds.rel_l2, ds.max_abs,
      ds.lse_max_abs, plan.splits, kernels::ScheduleName(plan.schedule), ws_bytes);
  EXPECT_EQ(ds.nan_test, 0);
  EXPECT_LE(ds.rel_l2, testing::kCustomMaxRelL2);
  EXPECT_LE(ds.max_abs, testing::kMaxAbs);
  EXPECT_LE(ds.lse_max_abs, testing::kLseMaxAbs);
}

std::string ParamName(const ::testing::TestParamInfo<std::tuple<KernelCase, KernelConfig>>& i) {
  return std::get<0>(i.param).name + "__" + std::get<1>(i.param).name;
}

INSTANTIATE_TEST_SUITE_P(Small, CustomKernelTest,
                         ::testing::Combine(::testing::ValuesIn(SmallCases()),
                                            ::testing::ValuesIn(Configs())),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Grid, CustomKernelTest,
                         ::testing::Combine(::testing::ValuesIn(GridCases()),
                                            ::testing::ValuesIn(Configs())),
                         ParamName);

// The same launch twice gives bit-identical output: no race between warps or splits.
TEST(CustomKernelDeterminism, RepeatedLaunchIsBitIdentical) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  RandomBundleSpec spec;
  spec.batch = 3;
  spec.draft = 17;
  spec.heads = 16;
  spec.page_size = 16;
  spec.prefix = 3000;
  spec.seed = 77;
  std::printf("[ case     ] determinism seed=%llu\n", static_cast<unsigned long long>(spec.seed));
  RandomBundle bundle(spec);
  DeviceBundle dev;
  ASSERT_EQ(dev.Upload(bundle.view()), cudaSuccess);
  for (const KernelConfig& k : Configs()) {
    if (!RunsHere(k, dev.problem)) continue;
    CustomConfig c = k.config;
    c.force_splits = 4;
    const size_t ws_bytes = kernels::CustomVariantWorkspaceBytes(dev.problem, c, k.schedule);
    DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
    std::vector<uint16_t> first(bundle.view().o_elems()), again(first.size());
    for (auto* out : {&first, &again}) {
      ASSERT_EQ(dev.Poison(), cudaSuccess);
      ASSERT_EQ(kernels::LaunchCustomVariant(dev.problem, c, k.schedule, ws.get<void>(), ws_bytes,
                                             nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(out->data(), dev.o.get<void>(), out->size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    EXPECT_EQ(first, again) << k.name;
  }
}

// The determinism probe: on one long random-valued bundle (8 requests at a 32K prefix, the
// planner's split, 64 steps per CTA), every configuration's output in four launches is the first
// launch's bit for bit. A race between the warpgroups' handoffs that the oracle check lets pass
// (a stale P tile read in a few steps shifts an output by less than the tolerance) changes bits
// from launch to launch.
TEST(CustomKernelDeterminism, LongRandomBundleIsBitIdentical) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  RandomBundleSpec spec;
  spec.batch = 8;
  spec.draft = 16;
  spec.heads = 16;
  spec.page_size = 64;
  spec.prefix = 32768;
  spec.seed = 78;
  std::printf("[ case     ] long determinism seed=%llu\n",
              static_cast<unsigned long long>(spec.seed));
  RandomBundle bundle(spec);
  DeviceBundle dev;
  ASSERT_EQ(dev.Upload(bundle.view()), cudaSuccess);
  for (const KernelConfig& k : Configs()) {
    if (!RunsHere(k, dev.problem)) continue;
    const size_t ws_bytes = kernels::CustomVariantWorkspaceBytes(dev.problem, k.config, k.schedule);
    DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
    std::vector<uint16_t> first(bundle.view().o_elems()), again(first.size());
    std::vector<float> first_lse(bundle.view().lse_elems()), again_lse(first_lse.size());
    for (int run = 0; run < 4; ++run) {
      std::vector<uint16_t>& out = run == 0 ? first : again;
      std::vector<float>& out_lse = run == 0 ? first_lse : again_lse;
      ASSERT_EQ(dev.Poison(), cudaSuccess);
      ASSERT_EQ(kernels::LaunchCustomVariant(dev.problem, k.config, k.schedule, ws.get<void>(),
                                             ws_bytes, nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(out.data(), dev.o.get<void>(), out.size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(out_lse.data(), dev.lse.get<void>(), out_lse.size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (run == 0) continue;
      EXPECT_EQ(first, again) << k.name << ": launch " << run + 1 << " differs from the first";
      EXPECT_EQ(0, std::memcmp(first_lse.data(), again_lse.data(), first_lse.size() * 4))
          << k.name << ": lse of launch " << run + 1 << " differs from the first";
    }
  }
}

// The shipped choice: v5t on an sm_90 device for a bf16 pool and v3e for an e4m3 one, the sm_120
// tiles with `small_smem` and on any other device; a named schedule is what runs, or is refused.
TEST(CustomKernelLaunch, ShipsOneSchedulePerArchitecture) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  int dev = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), cudaSuccess);
  const bool sm90 = major == 9 && minor == 0;
  RandomBundleSpec spec;
  spec.batch = 8;
  spec.draft = 16;
  spec.heads = 8;
  spec.prefix = 4096;
  RandomBundle bundle(spec);
  DeviceBundle dev_bundle;
  ASSERT_EQ(dev_bundle.Upload(bundle.view()), cudaSuccess);
  kernels::CustomPlan shipped, v4, small;
  ASSERT_EQ(kernels::ResolveCustomPlan(dev_bundle.problem, {}, &shipped), cudaSuccess);
  EXPECT_EQ(shipped.schedule,
            sm90 ? kernels::CustomSchedule::kV5t : kernels::CustomSchedule::kSmallTiles);
  const cudaError_t v4_error =
      kernels::ResolveCustomPlan(dev_bundle.problem, {}, &v4, kernels::CustomSchedule::kV4);
  EXPECT_EQ(v4_error, sm90 ? cudaSuccess : cudaErrorNotSupported);
  if (sm90) {
    EXPECT_EQ(v4.schedule, kernels::CustomSchedule::kV4);
  }
  CustomConfig sm120;
  sm120.small_smem = true;
  ASSERT_EQ(kernels::ResolveCustomPlan(dev_bundle.problem, sm120, &small), cudaSuccess);
  EXPECT_EQ(small.schedule, kernels::CustomSchedule::kSmallTiles);
  EXPECT_EQ(
      kernels::ResolveCustomPlan(dev_bundle.problem, sm120, &small, kernels::CustomSchedule::kV5t),
      cudaErrorNotSupported)
      << "a Hopper schedule named beside the sm_120 tiles";
  // v3e takes an e4m3 pool only, and kAuto gives such a pool v3e where it runs.
  EXPECT_EQ(kernels::ResolveCustomPlan(dev_bundle.problem, {}, &v4, kernels::CustomSchedule::kV3e),
            sm90 ? cudaErrorInvalidValue : cudaErrorNotSupported);
  kernels::VerifyProblem e4m3 = dev_bundle.problem;
  e4m3.shape.kv_dtype = kernels::KvDtype::kE4m3;
  e4m3.kv_scale = 0.5f;
  kernels::CustomPlan codes;
  EXPECT_EQ(kernels::ResolveCustomPlan(e4m3, {}, &codes),
            sm90 ? cudaSuccess : cudaErrorNotSupported);
  if (sm90) {
    EXPECT_EQ(codes.schedule, kernels::CustomSchedule::kV3e);
  }
  EXPECT_EQ(kernels::ResolveCustomPlan(e4m3, sm120, &codes), cudaErrorNotSupported);
  // The shipped library launches no bench-only schedule.
  EXPECT_EQ(kernels::LaunchCustomWith(dev_bundle.problem, {}, kernels::CustomSchedule::kV5, nullptr,
                                      0, nullptr),
            cudaErrorNotSupported);
}

// Too small a workspace is refused before anything is launched.
TEST(CustomKernelLaunch, RefusesShortWorkspace) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  RandomBundleSpec spec;
  spec.draft = 4;
  spec.heads = 8;
  spec.prefix = 5000;
  RandomBundle bundle(spec);
  DeviceBundle dev;
  ASSERT_EQ(dev.Upload(bundle.view()), cudaSuccess);
  CustomConfig c;
  c.force_splits = 4;
  const size_t ws_bytes = kernels::CustomWorkspaceBytes(dev.problem, c);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer ws(ws_bytes);
  EXPECT_EQ(kernels::LaunchCustom(dev.problem, c, ws.get<void>(), ws_bytes - 1, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchCustom(dev.problem, c, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace verifyd
