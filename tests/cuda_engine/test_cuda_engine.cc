// The CUDA engine's reference, custom and oracle paths against the CPU fp64 oracle on a cut of
// the shape grid and on every golden case; the on-device comparison against the host one; fault
// injection; concurrent use. Skips without a GPU.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_engine.h"
#include "src/cuda_engine/cuda_engine.h"
#include "src/engine/call_context.h"
#include "src/io/bundle_file.h"
#include "src/region/mapped_region.h"
#include "src/region/region_registry.h"
#include "tests/common/device_bundle.h"
#include "tests/common/e4m3_rounding.h"
#include "tests/common/gpu_test_support.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;
using kernels::MaskFormat;

Engine* Gpu() {
  static std::unique_ptr<Engine> engine = [] {
    absl::Status st;
    CudaEngineOptions options;
    options.memory_pool_bytes = size_t{16} << 30;
    auto e = MakeCudaEngine(options, &st);
    if (e == nullptr) std::fprintf(stderr, "MakeCudaEngine: %s\n", st.ToString().c_str());
    return e;
  }();
  return engine.get();
}

Engine* Cpu() {
  static std::unique_ptr<Engine> engine = MakeCpuEngine(0);
  return engine.get();
}

#define REQUIRE_GPU_ENGINE()    \
  do {                          \
    VERIFYD_SKIP_WITHOUT_GPU(); \
    ASSERT_NE(Gpu(), nullptr);  \
  } while (0)

// Worst numbers over the suite, printed at the end.
struct Worst {
  double reference = 0, custom = 0, oracle = 0, ref_lse = 0, custom_lse = 0, oracle_lse = 0;
  int cases = 0, custom_failures = 0;
};
Worst g_worst;

class PrintWorst : public ::testing::Environment {
 public:
  void TearDown() override {
    if (g_worst.cases == 0) return;
    std::printf(
        "cuda engine vs fp64 oracle over %d cases: worst rel_l2 reference %.3g, custom %.3g, "
        "oracle %.3g; worst lse max_abs reference %.3g, custom %.3g, oracle %.3g; custom path "
        "failures %d\n",
        g_worst.cases, g_worst.reference, g_worst.custom, g_worst.oracle, g_worst.ref_lse,
        g_worst.custom_lse, g_worst.oracle_lse, g_worst.custom_failures);
  }
};
const auto* const g_env = ::testing::AddGlobalTestEnvironment(new PrintWorst);

struct Truth {
  const float* o;    // fp32 [B*T, H, 512]
  const float* lse;  // fp32 [B*T, H]
};

// Runs the three GPU paths on `v` and checks each against `truth` (the fp64 oracle), the rows
// that see nothing, and the on-device comparisons against the host ones.
void CheckGpuPaths(const BundleView& v, const Truth& truth, const std::string& label,
                   double oracle_max_rel = testing::kOracleMaxRelL2) {
  SCOPED_TRACE(label);
  Engine& gpu = *Gpu();
  auto pb = gpu.Prepare(v, /*detach=*/false);
  ASSERT_TRUE(pb.ok()) << pb.status();
  PreparedBundle& b = **pb;
  PathOutput ref, cus, orc;
  for (auto [path, out] : {std::pair{Path::kReference, &ref}, std::pair{Path::kOracle, &orc}}) {
    const absl::Status run = gpu.Run(path, b);
    ASSERT_TRUE(run.ok()) << run;
    const absl::Status fetch = gpu.Fetch(path, b, out);
    ASSERT_TRUE(fetch.ok()) << fetch;
  }
  absl::Status custom_st = gpu.Run(Path::kCustom, b);
  if (custom_st.ok()) custom_st = gpu.Fetch(Path::kCustom, b, &cus);
  const bool have_custom = custom_st.ok();
  EXPECT_TRUE(custom_st.ok()) << "custom path: " << custom_st;
  if (!have_custom) ++g_worst.custom_failures;

  const int64_t n = v.o_elems(), n_lse = v.lse_elems();
  ASSERT_EQ(static_cast<int64_t>(ref.o.size()), n);
  ASSERT_EQ(static_cast<int64_t>(orc.o_f32.size()), n);

  // NaN/Inf first: a read of a NaN-poisoned pool slot shows up here.
  const Tolerance tol;
  const DiffStats r =
      CompareBf16ToF32(ref.o.data(), truth.o, n, ref.lse.data(), truth.lse, n_lse, tol);
  EXPECT_EQ(r.nan_test + r.inf_test, 0) << "reference";
  EXPECT_EQ(r.nan_ref + r.inf_ref, 0) << "oracle";
  int64_t orc_bad = 0;
  for (float x : orc.o_f32) orc_bad += !std::isfinite(x);
  EXPECT_EQ(orc_bad, 0) << "gpu oracle";
  EXPECT_LT(r.rel_l2, testing::kReferenceMaxRelL2) << "reference";
  EXPECT_LE(r.lse_max_abs, testing::kLseMaxAbs) << "reference lse";
  const double orc_rel = testing::RelL2(orc.o_f32, truth.o, n);
  const double orc_lse = testing::LseMaxAbs(orc.lse, truth.lse, n_lse);
  EXPECT_LT(orc_rel, oracle_max_rel) << "gpu oracle";
  EXPECT_LE(orc_lse, testing::kOracleLseMaxAbs) << "gpu oracle lse";

  DiffStats c;
  if (have_custom) {
    c = CompareBf16ToF32(cus.o.data(), truth.o, n, cus.lse.data(), truth.lse, n_lse, tol);
    EXPECT_EQ(c.nan_test + c.inf_test, 0) << "custom";
    EXPECT_LT(c.rel_l2, testing::kCustomMaxRelL2) << "custom";
    EXPECT_LE(c.lse_max_abs, testing::kLseMaxAbs) << "custom lse";
  }

  // Rows that see nothing: lse -inf and zero output on every path.
  int empty_rows = 0;
  for (int64_t row = 0; row < n_lse; ++row) {
    if (truth.lse[row] != -INFINITY) continue;
    ++empty_rows;
    EXPECT_EQ(ref.lse[row], -INFINITY) << "reference row " << row;
    EXPECT_EQ(orc.lse[row], -INFINITY) << "oracle row " << row;
    if (have_custom) {
      EXPECT_EQ(cus.lse[row], -INFINITY) << "custom row " << row;
    }
    for (int d = 0; d < kernels::kHeadDimV; ++d) {
      const int64_t k = row * kernels::kHeadDimV + d;
      ASSERT_EQ(Bf16ToFloat(ref.o[k]), 0.f) << "reference row " << row;
      ASSERT_EQ(orc.o_f32[k], 0.f) << "oracle row " << row;
      if (have_custom) {
        ASSERT_EQ(Bf16ToFloat(cus.o[k]), 0.f) << "custom row " << row;
      }
    }
  }

  // The on-device reduction equals the host comparison of the same outputs.
  auto dev_ref_orc = gpu.Compare(b, Path::kReference, Path::kOracle, tol);
  ASSERT_TRUE(dev_ref_orc.ok()) << dev_ref_orc.status();
  testing::ExpectSameStats(*dev_ref_orc,
                           CompareBf16ToF32(ref.o.data(), orc.o_f32.data(), n, ref.lse.data(),
                                            orc.lse.data(), n_lse, tol));
  if (have_custom) {
    auto dev_cus_ref = gpu.Compare(b, Path::kCustom, Path::kReference, tol);
    ASSERT_TRUE(dev_cus_ref.ok()) << dev_cus_ref.status();
    testing::ExpectSameStats(*dev_cus_ref, CompareBf16(cus.o.data(), ref.o.data(), n,
                                                       cus.lse.data(), ref.lse.data(), n_lse, tol));
    auto dev_cus_orc = gpu.Compare(b, Path::kCustom, Path::kOracle, tol);
    ASSERT_TRUE(dev_cus_orc.ok()) << dev_cus_orc.status();
    testing::ExpectSameStats(*dev_cus_orc,
                             CompareBf16ToF32(cus.o.data(), orc.o_f32.data(), n, cus.lse.data(),
                                              orc.lse.data(), n_lse, tol));
  }

  ++g_worst.cases;
  g_worst.reference = std::max(g_worst.reference, r.rel_l2);
  g_worst.ref_lse = std::max(g_worst.ref_lse, r.lse_max_abs);
  g_worst.oracle = std::max(g_worst.oracle, orc_rel);
  g_worst.oracle_lse = std::max(g_worst.oracle_lse, orc_lse);
  if (have_custom) {
    g_worst.custom = std::max(g_worst.custom, c.rel_l2);
    g_worst.custom_lse = std::max(g_worst.custom_lse, c.lse_max_abs);
  }
  std::printf(
      "%s: rel_l2 reference %.3g custom %s oracle %.2g | lse reference %.2g custom %s oracle "
      "%.2g | empty rows %d | ms reference %.3f custom %s oracle %.3f\n",
      label.c_str(), r.rel_l2, have_custom ? std::to_string(c.rel_l2).c_str() : "n/a", orc_rel,
      r.lse_max_abs, have_custom ? std::to_string(c.lse_max_abs).c_str() : "n/a", orc_lse,
      empty_rows, ref.seconds * 1e3,
      have_custom ? std::to_string(cus.seconds * 1e3).c_str() : "n/a", orc.seconds * 1e3);
}

// The fp64 oracle of the CPU engine, stored as fp32.
struct CpuTruth {
  PathOutput out;
  Truth truth() const { return {out.o_f32.data(), out.lse.data()}; }
};

CpuTruth CpuOracle(const BundleView& v) {
  CpuTruth t;
  auto pb = Cpu()->Prepare(v, false);
  EXPECT_TRUE(pb.ok()) << pb.status();
  if (!pb.ok()) return t;
  EXPECT_TRUE(Cpu()->Run(Path::kOracle, **pb).ok());
  EXPECT_TRUE(Cpu()->Fetch(Path::kOracle, **pb, &t.out).ok());
  return t;
}

std::string Describe(const RandomBundleSpec& s) {
  std::string prefixes;
  for (int64_t p : s.prefix_lens) prefixes += (prefixes.empty() ? "" : "_") + std::to_string(p);
  if (prefixes.empty()) prefixes = std::to_string(s.prefix);
  return "B" + std::to_string(s.batch) + "_T" + std::to_string(s.draft) + "_H" +
         std::to_string(s.heads) + "_page" + std::to_string(s.page_size) + "_prefix" + prefixes +
         (s.tree == TreeKind::kChain ? "_chain" : "_tree") +
         (s.mask_format == MaskFormat::kBits ? "_bits" : "_bytes") +
         (s.empty_row ? "_emptyrow" : "") + "_seed" + std::to_string(s.seed);
}

// T {1,3,17,64} x H {8,16,128} x page {1,16,64}, the prefix cycling through {0,54,4096} where
// the CPU oracle stays cheap (query rows x keys), chains and random trees, byte and bit masks,
// an empty row every fifth case; two requests with different prefix lengths.
std::vector<RandomBundleSpec> GridCut() {
  constexpr int64_t kCpuRowKeys = int64_t{8} << 20;
  std::vector<RandomBundleSpec> specs;
  int i = 0;
  for (int t : {1, 3, 17, 64}) {
    for (int h : {8, 16, 128}) {
      for (int page : {1, 16, 64}) {
        RandomBundleSpec s;
        s.batch = 2;
        s.draft = t;
        s.heads = h;
        s.page_size = page;
        int64_t prefix = std::vector<int64_t>{0, 54, 4096}[i % 3];
        if (int64_t{2} * t * h * (prefix + t) > kCpuRowKeys) prefix = 54;
        s.prefix_lens = {prefix, std::max<int64_t>(0, prefix - 7)};
        s.tree = i % 2 == 0 ? TreeKind::kRandomTree : TreeKind::kChain;
        s.mask_format = (i / 2) % 2 == 0 ? MaskFormat::kBytes : MaskFormat::kBits;
        s.empty_row = i % 5 == 0;
        s.seed = 1000 + i;
        specs.push_back(s);
        ++i;
      }
    }
  }
  return specs;
}

class GridCase : public ::testing::TestWithParam<RandomBundleSpec> {};

TEST_P(GridCase, AllPathsMatchTheFp64Oracle) {
  REQUIRE_GPU_ENGINE();
  RandomBundle rb(GetParam());
  const CpuTruth t = CpuOracle(rb.view());
  ASSERT_FALSE(t.out.o_f32.empty());
  CheckGpuPaths(rb.view(), t.truth(), Describe(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Grid, GridCase, ::testing::ValuesIn(GridCut()),
                         [](const auto& info) { return Describe(info.param); });

// Shapes too large for the CPU oracle within the suite's time: the GPU paths against the GPU
// fp32 oracle (itself held to the fp64 oracle above).
TEST(LargeShapes, ReferenceAndCustomMatchTheGpuOracle) {
  REQUIRE_GPU_ENGINE();
  std::vector<RandomBundleSpec> specs(4);
  specs[0].batch = 2, specs[0].draft = 64, specs[0].heads = 128, specs[0].page_size = 64;
  specs[0].prefix = 4096, specs[0].seed = 71;
  specs[1].batch = 3, specs[1].draft = 17, specs[1].heads = 128, specs[1].page_size = 16;
  specs[1].prefix_lens = {4096, 97, 1}, specs[1].mask_format = MaskFormat::kBits;
  specs[1].seed = 72;
  specs[2].batch = 4, specs[2].draft = 1, specs[2].heads = 128, specs[2].page_size = 64;
  specs[2].prefix = 32768, specs[2].seed = 73;
  specs[3].batch = 1, specs[3].draft = 256, specs[3].heads = 16, specs[3].page_size = 1;
  specs[3].prefix = 1000, specs[3].empty_row = true, specs[3].seed = 74;
  for (const RandomBundleSpec& s : specs) {
    RandomBundle rb(s);
    const BundleView& v = rb.view();
    auto pb = Gpu()->Prepare(v, false);
    ASSERT_TRUE(pb.ok()) << pb.status();
    PathOutput orc;
    ASSERT_TRUE(Gpu()->Run(Path::kOracle, **pb).ok());
    ASSERT_TRUE(Gpu()->Fetch(Path::kOracle, **pb, &orc).ok());
    // fp32 vs fp32 here: the bound is the GPU oracle's own error, not the fp64 one's.
    CheckGpuPaths(v, Truth{orc.o_f32.data(), orc.lse.data()}, "large " + Describe(s), 1e-7);
  }
}

std::vector<std::string> GoldenCases() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(testing::TestDataDir()) / "golden", ec)) {
    if (e.path().extension() == ".safetensors") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, AllPathsMatchTheStoredOracle) {
  REQUIRE_GPU_ENGINE();
  const std::string path =
      (fs::path(testing::TestDataDir()) / "golden" / (GetParam() + ".safetensors")).string();
  auto file = LoadBundleFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  BundleView v = file->view;
  const absl::Status valid = ValidateBundle(v);
  ASSERT_TRUE(valid.ok()) << valid;
  ASSERT_NE(file->o_expected, nullptr);
  ASSERT_NE(file->lse_expected, nullptr);
  CheckGpuPaths(v, Truth{file->o_expected->as<float>(), file->lse_expected->as<float>()},
                "golden " + GetParam());
}

INSTANTIATE_TEST_SUITE_P(Cases, Golden, ::testing::ValuesIn(GoldenCases()),
                         [](const auto& info) { return info.param; });

TEST(GoldenFiles, Present) {
  EXPECT_GE(GoldenCases().size(), 6u) << "golden cases missing under " << testing::TestDataDir();
}

TEST(CudaEngine, InfoNamesTheDevice) {
  REQUIRE_GPU_ENGINE();
  const EngineInfo info = Gpu()->Info();
  EXPECT_EQ(info.engine, "cuda");
  EXPECT_FALSE(info.device.empty());
  EXPECT_GT(info.sm_count, 0);
  EXPECT_FALSE(info.compute_capability.empty());
  std::printf("engine %s, device %s, %d SMs, compute capability %s, %d visible GPU(s)\n",
              info.engine.c_str(), info.device.c_str(), info.sm_count,
              info.compute_capability.c_str(), VisibleCudaDevices());
}

// Three requests of 7 draft tokens and 16 heads over an e4m3 pool at `scale` (prefixes 130, 0 and
// 1000: off the tile, and empty), realistic traffic.
RandomBundleSpec RaggedE4m3Spec(float scale, int page, uint64_t seed) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 7;
  s.heads = 16;
  s.page_size = page;
  s.prefix_lens = {130, 0, 1000};
  s.traffic = Traffic::kRealistic;
  s.seed = seed;
  s.kv_dtype = kernels::KvDtype::kE4m3;
  s.kv_scale = scale;
  return s;
}

// An e4m3 pool: the named pages dequantised on the device, the scale on the logits and on o. Every
// path matches the fp64 oracle of the e4m3 values (the CPU engine's, which reads e4m3 x
// kv_scale), at a scale of 1 and at scales that are not powers of two; a capture of the call
// keeps the e4m3 bytes and the scale.
TEST(CudaEngine, AnE4m3PoolMatchesTheOracleOfItsValues) {
  REQUIRE_GPU_ENGINE();
  auto cpu = MakeCpuEngine(2);
  for (float scale : {1.f, 0.37f, 3.1f}) {
    for (int page : {1, 64}) {
      RandomBundle rb(RaggedE4m3Spec(scale, page, 40 + page));
      BundleView v = rb.view();
      ASSERT_TRUE(ValidateBundle(v).ok());
      const std::string what = absl::StrCat("scale ", scale, " page ", page);
      auto want = cpu->Prepare(v, false);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_TRUE(cpu->Run(Path::kOracle, **want).ok());
      PathOutput oracle;
      ASSERT_TRUE(cpu->Fetch(Path::kOracle, **want, &oracle).ok());
      auto pb = Gpu()->Prepare(v, /*detach=*/true);
      ASSERT_TRUE(pb.ok()) << what << ": " << pb.status();
      for (Path p : {Path::kReference, Path::kCustom, Path::kOracle}) {
        ASSERT_TRUE(Gpu()->Run(p, **pb).ok()) << what << " " << PathName(p);
        PathOutput got;
        ASSERT_TRUE(Gpu()->Fetch(p, **pb, &got).ok()) << what << " " << PathName(p);
        const DiffStats d =
            p == Path::kOracle
                ? CompareF32(got.o_f32.data(), oracle.o_f32.data(), v.o_elems(), got.lse.data(),
                             oracle.lse.data(), v.lse_elems(), Tolerance{})
                : CompareBf16ToF32(got.o.data(), oracle.o_f32.data(), v.o_elems(), got.lse.data(),
                                   oracle.lse.data(), v.lse_elems(), Tolerance{});
        const Verdict verdict = Judge(d, Tolerance{});
        EXPECT_TRUE(verdict.match) << what << " " << PathName(p) << ": " << verdict.reason;
        EXPECT_LT(d.rel_l2, p == Path::kOracle ? 1e-5 : 1e-2) << what << " " << PathName(p);
        EXPECT_LT(d.lse_max_abs, 1e-3) << what << " " << PathName(p);
      }
      auto inputs = Gpu()->FetchInputs(**pb);
      ASSERT_TRUE(inputs.ok()) << inputs.status();
      const BundleView& c = (*inputs)->view();
      EXPECT_EQ(c.shape.kv_dtype, kernels::KvDtype::kE4m3) << what;
      EXPECT_EQ(c.kv_scale, scale) << what;
      EXPECT_EQ(c.sm_scale, v.sm_scale) << what;
      for (int b = 0; b < c.shape.batch; ++b) {
        for (int64_t t = 0; t < c.kv_lens[b]; t += 37) {
          float x[kernels::kHeadDimQK], y[kernels::kHeadDimQK];
          v.KvRowFloat(b, t, kernels::kHeadDimQK, x);
          c.KvRowFloat(b, t, kernels::kHeadDimQK, y);
          ASSERT_EQ(std::memcmp(x, y, sizeof x), 0) << what << " request " << b << " token " << t;
        }
      }
    }
  }
}

// The scale goes onto o before its one rounding (VerifyProblem::o_scale) in both served paths on
// the dequantised pages: on a bundle where every row is the scaled mean of 64 V rows, each path's
// o is the oracle's rounded to bf16 in nearly every element; a path that scaled its rounded o
// (as the engine did before) misses it in about a quarter (tests/common/e4m3_rounding.h).
TEST(CudaEngine, AnE4m3PoolsScaleGoesOnBeforeOsOneRounding) {
  REQUIRE_GPU_ENGINE();
  auto cpu = MakeCpuEngine(2);
  for (float scale : {0.37f, 3.1f}) {
    for (int page : {1, 64}) {
      RandomBundle rb(EqualWeightsE4m3Spec(scale, page, 17 + page));
      const BundleView& v = rb.view();
      auto want = cpu->Prepare(v, false);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_TRUE(cpu->Run(Path::kOracle, **want).ok());
      PathOutput oracle;
      ASSERT_TRUE(cpu->Fetch(Path::kOracle, **want, &oracle).ok());
      const double twice = ShareIfRoundedTwice(oracle.o_f32, scale);
      EXPECT_LT(twice, 0.9) << "the bundle does not tell one rounding from two";
      auto pb = Gpu()->Prepare(v, /*detach=*/true);
      ASSERT_TRUE(pb.ok()) << pb.status();
      for (Path p : {Path::kReference, Path::kCustom}) {
        ASSERT_TRUE(Gpu()->Run(p, **pb).ok()) << PathName(p);
        PathOutput got;
        ASSERT_TRUE(Gpu()->Fetch(p, **pb, &got).ok()) << PathName(p);
        const double once = ShareRoundedOnce(got.o, oracle.o_f32);
        std::printf("[ metrics  ] %s scale %g page %d: %.4f of o rounded once (%.4f if twice)\n",
                    PathName(p), scale, page, once, twice);
        EXPECT_GT(once, 0.97) << PathName(p) << " scale " << scale << " page " << page;
      }
    }
  }
}

// Where the kernel that reads e4m3 codes runs (v3e, sm_90), the custom path reads an e4m3 pool's
// codes as sent, not the dequantised pages the reference reads: its output is v3e's on the bundle
// as sent, bit for bit, so a wrong dequantisation shows as a difference between the paths.
TEST(CudaEngine, TheCustomPathReadsAnE4m3PoolsCodesWhereV3eRuns) {
  REQUIRE_GPU_ENGINE();
  for (int page : {1, 64}) {
    RandomBundle rb(RaggedE4m3Spec(0.37f, page, 60 + page));
    BundleView v = rb.view();
    ASSERT_TRUE(ValidateBundle(v).ok());
    testing::DeviceBundle dev;
    ASSERT_EQ(dev.Upload(v), cudaSuccess);
    const kernels::CustomConfig config;
    kernels::CustomPlan plan;
    if (kernels::ResolveCustomPlan(dev.problem, config, &plan) != cudaSuccess) {
      GTEST_SKIP() << "v3e does not run on this device: the custom path reads the dequantised "
                      "pages";
    }
    ASSERT_EQ(plan.schedule, kernels::CustomSchedule::kV3e);
    testing::DeviceBuffer ws(std::max<size_t>(plan.workspace_bytes, 16));
    ASSERT_EQ(
        kernels::LaunchCustom(dev.problem, config, ws.get<void>(), plan.workspace_bytes, nullptr),
        cudaSuccess);
    std::vector<uint16_t> o(v.o_elems());
    std::vector<float> lse(v.lse_elems());
    ASSERT_EQ(cudaMemcpy(o.data(), dev.o.get<void>(), o.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), dev.lse.get<void>(), lse.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    auto pb = Gpu()->Prepare(v, /*detach=*/true);
    ASSERT_TRUE(pb.ok()) << pb.status();
    ASSERT_TRUE(Gpu()->Run(Path::kCustom, **pb).ok());
    PathOutput got;
    ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, **pb, &got).ok());
    ASSERT_EQ(got.o.size(), o.size());
    EXPECT_EQ(std::memcmp(got.o.data(), o.data(), o.size() * 2), 0) << "page " << page;
    ASSERT_EQ(got.lse.size(), lse.size());
    EXPECT_EQ(std::memcmp(got.lse.data(), lse.data(), lse.size() * 4), 0) << "page " << page;
  }
}

TEST(CudaEngine, RefusesUnvalidatedBundlesAndPathsThatHaveNotRun) {
  REQUIRE_GPU_ENGINE();
  RandomBundleSpec s;
  s.draft = 3;
  s.prefix = 10;
  s.seed = 5;
  RandomBundle rb(s);
  BundleView unvalidated = rb.view();
  unvalidated.max_kv_len = 0;
  EXPECT_EQ(Gpu()->Prepare(unvalidated, false).status().code(), absl::StatusCode::kInvalidArgument);
  BundleView bad_shape = rb.view();
  bad_shape.shape.heads = 0;
  EXPECT_EQ(Gpu()->Prepare(bad_shape, false).status().code(), absl::StatusCode::kInvalidArgument);

  auto pb = Gpu()->Prepare(rb.view(), false);
  ASSERT_TRUE(pb.ok()) << pb.status();
  PathOutput out;
  EXPECT_EQ(Gpu()->Fetch(Path::kCustom, **pb, &out).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Gpu()->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
  ASSERT_TRUE(Gpu()->Run(Path::kOracle, **pb).ok());
  EXPECT_EQ(Gpu()->Compare(**pb, Path::kOracle, Path::kReference, Tolerance{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Restores the engine's fault setting at the end of a test.
struct FaultGuard {
  ~FaultGuard() {
    if (testing::NoGpuReason().empty() && Gpu() != nullptr) Gpu()->InjectCustomFault(CustomFault{});
  }
};

class FaultInjection : public ::testing::Test {
 protected:
  void SetUp() override {
    VERIFYD_SKIP_WITHOUT_GPU();
    ASSERT_NE(Gpu(), nullptr);
    RandomBundleSpec s;
    s.batch = 2;
    s.draft = 5;
    s.heads = 16;
    s.page_size = 16;
    s.prefix = 70;
    s.seed = 9;
    rb_ = std::make_unique<RandomBundle>(s);
    auto pb = Gpu()->Prepare(rb_->view(), false);
    ASSERT_TRUE(pb.ok()) << pb.status();
    pb_ = *pb;
    ASSERT_TRUE(Gpu()->Run(Path::kReference, *pb_).ok());
  }
  std::unique_ptr<RandomBundle> rb_;
  std::shared_ptr<PreparedBundle> pb_;
  FaultGuard guard_;
};

TEST_F(FaultInjection, ErrorFailsTheCustomRunOnly) {
  CustomFault f;
  f.kind = CustomFault::Kind::kError;
  Gpu()->InjectCustomFault(f);
  const absl::Status st = Gpu()->Run(Path::kCustom, *pb_);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("injected"), std::string::npos) << st;
  PathOutput ref;
  EXPECT_TRUE(Gpu()->Fetch(Path::kReference, *pb_, &ref).ok());
  EXPECT_EQ(Gpu()->Compare(*pb_, Path::kCustom, Path::kReference, Tolerance{}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Cleared: the same bundle runs the custom path again.
  Gpu()->InjectCustomFault(CustomFault{});
  EXPECT_TRUE(Gpu()->Run(Path::kCustom, *pb_).ok());
}

TEST_F(FaultInjection, PerturbShowsInTheDeviceComparison) {
  CustomFault f;
  f.kind = CustomFault::Kind::kPerturb;
  f.amount = 0.5;
  Gpu()->InjectCustomFault(f);
  ASSERT_TRUE(Gpu()->Run(Path::kCustom, *pb_).ok());
  auto d = Gpu()->Compare(*pb_, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_GT(d->max_abs, 0.4);
  EXPECT_LT(d->max_abs, 0.7);
  EXPECT_GT(d->beyond_tol, d->count / 2);
  EXPECT_FALSE(Judge(*d, Tolerance{}).match);
  PathOutput cus, ref;
  ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, *pb_, &cus).ok());
  ASSERT_TRUE(Gpu()->Fetch(Path::kReference, *pb_, &ref).ok());
  testing::ExpectSameStats(
      *d,
      CompareBf16(cus.o.data(), ref.o.data(), static_cast<int64_t>(ref.o.size()), cus.lse.data(),
                  ref.lse.data(), static_cast<int64_t>(ref.lse.size()), Tolerance{}));
}

TEST_F(FaultInjection, NanIsCountedAndBreaches) {
  CustomFault f;
  f.kind = CustomFault::Kind::kNan;
  Gpu()->InjectCustomFault(f);
  ASSERT_TRUE(Gpu()->Run(Path::kCustom, *pb_).ok());
  auto d = Gpu()->Compare(*pb_, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->nan_test, 1);
  EXPECT_EQ(d->nan_ref, 0);
  EXPECT_TRUE(std::isinf(d->max_abs));
  const Verdict v = Judge(*d, Tolerance{});
  EXPECT_FALSE(v.match);
  EXPECT_NE(v.reason.find("nan"), std::string::npos) << v.reason;
}

TEST_F(FaultInjection, TheDeviceFiniteCheckCatchesANanInTheServedOutput) {
  EXPECT_EQ(Gpu()->AllFinite(Path::kCustom, *pb_).status().code(),
            absl::StatusCode::kFailedPrecondition);  // custom has not run yet
  CustomFault f;
  f.kind = CustomFault::Kind::kNan;
  Gpu()->InjectCustomFault(f);
  ASSERT_TRUE(Gpu()->Run(Path::kCustom, *pb_).ok());
  absl::StatusOr<bool> finite = Gpu()->AllFinite(Path::kCustom, *pb_);
  ASSERT_TRUE(finite.ok()) << finite.status();
  EXPECT_FALSE(*finite);
  finite = Gpu()->AllFinite(Path::kReference, *pb_);
  ASSERT_TRUE(finite.ok()) << finite.status();
  EXPECT_TRUE(*finite);
  Gpu()->InjectCustomFault(CustomFault{});
  ASSERT_TRUE(Gpu()->Run(Path::kCustom, *pb_).ok());
  finite = Gpu()->AllFinite(Path::kCustom, *pb_);
  ASSERT_TRUE(finite.ok()) << finite.status();
  EXPECT_TRUE(*finite);  // the flag is cleared between checks
  EXPECT_EQ(Gpu()->AllFinite(Path::kOracle, *pb_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Device memory of this GPU as a region (what a CUDA IPC or VMM registration maps).
class DeviceMemoryRegion : public MappedRegion {
 public:
  explicit DeviceMemoryRegion(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&base_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(base_, 0xAB, bytes), cudaSuccess);
  }
  ~DeviceMemoryRegion() override { cudaFree(base_); }
  char* base() const override { return static_cast<char*>(base_); }
  uint64_t byte_size() const override { return bytes_; }
  int device() const override { return 0; }
  absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const override {
    return cudaMemcpy(dst, base() + offset, bytes, cudaMemcpyDeviceToHost) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("cudaMemcpy");
  }

 private:
  void* base_ = nullptr;
  size_t bytes_;
};

// A served custom output bound for this GPU's memory is checked finite by the kernel that copies
// it there: the bytes that land are Fetch's, with lse or without, at a 16-byte-aligned offset (the
// vector copy) or 2 bytes past one (the scalar copy), and not a byte past the range; a NaN in the
// output is flagged (the bytes are still copied), and the flag is cleared for the next call.
TEST_F(FaultInjection, ADeliveryIntoDeviceMemoryIsCheckedAsItIsCopied) {
  const int64_t o_bytes = static_cast<int64_t>(rb_->view().o_elems()) * 2;
  const int64_t lse_bytes = static_cast<int64_t>(rb_->view().lse_elems()) * 4;
  for (bool nan : {false, true, false}) {
    for (uint64_t skew : {0, 2}) {
      for (bool with_lse : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << "nan " << nan << " skew " << skew << " lse " << with_lse);
        CustomFault f;
        if (nan) f.kind = CustomFault::Kind::kNan;
        Gpu()->InjectCustomFault(f);
        ASSERT_TRUE(Gpu()->RunForCall(Path::kCustom, *pb_, CallContext()).ok());
        PathOutput want;
        ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, *pb_, &want).ok());
        DeviceMemoryRegion region(static_cast<size_t>(o_bytes + lse_bytes) + 64);
        RegionRange o, lse;
        o.region = lse.region = &region;
        o.offset = 16 + skew;
        o.data = region.base() + o.offset;
        o.byte_size = static_cast<uint64_t>(o_bytes);
        lse.offset = (o.offset + o.byte_size + 31) / 16 * 16;  // regions' tensors: 16-aligned
        lse.data = region.base() + lse.offset;
        lse.byte_size = static_cast<uint64_t>(lse_bytes);
        absl::StatusOr<bool> finite =
            Gpu()->DeliverIfFinite(Path::kCustom, *pb_, o, with_lse ? &lse : nullptr);
        ASSERT_TRUE(finite.ok()) << finite.status();
        EXPECT_EQ(*finite, !nan);
        std::vector<char> got(region.byte_size());
        ASSERT_TRUE(region.ReadToHost(0, got.size(), got.data()).ok());
        EXPECT_EQ(std::memcmp(got.data() + o.offset, want.o.data(), o.byte_size), 0);
        EXPECT_EQ(static_cast<uint8_t>(got[o.offset - 1]), 0xAB);
        EXPECT_EQ(static_cast<uint8_t>(got[o.offset + o.byte_size]), 0xAB);
        if (with_lse) {
          EXPECT_EQ(std::memcmp(got.data() + lse.offset, want.lse.data(), lse.byte_size), 0);
        } else {
          EXPECT_EQ(static_cast<uint8_t>(got[lse.offset]), 0xAB);
        }
      }
    }
  }
}

// Warm device times of the paths (events around each path's kernels), median of 10 after two
// warm-up calls. A sanity check of speed, not the benchmark; the last shape is large enough that
// the reference splits each request's query rows into chunks.
TEST(CudaEngine, WarmPathTimes) {
  REQUIRE_GPU_ENGINE();
  struct Shape {
    int batch, draft, heads, page;
    int64_t prefix;
  };
  for (const Shape& sh :
       {Shape{8, 64, 128, 64, 4096}, Shape{32, 8, 16, 64, 8192}, Shape{1, 1024, 128, 64, 2048}}) {
    RandomBundleSpec s;
    s.batch = sh.batch;
    s.draft = sh.draft;
    s.heads = sh.heads;
    s.page_size = sh.page;
    s.prefix = sh.prefix;
    s.seed = 900;
    RandomBundle rb(s);
    const BundleView& v = rb.view();
    auto pb = Gpu()->Prepare(v, false);
    ASSERT_TRUE(pb.ok()) << pb.status();
    std::vector<double> ref_ms, cus_ms;
    for (int i = 0; i < 12; ++i) {
      PathOutput ref, cus;
      ASSERT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
      ASSERT_TRUE(Gpu()->Fetch(Path::kReference, **pb, &ref).ok());
      const absl::Status run = Gpu()->Run(Path::kCustom, **pb);
      ASSERT_TRUE(run.ok()) << run;
      ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, **pb, &cus).ok());
      if (i >= 2) {
        ref_ms.push_back(ref.seconds * 1e3);
        cus_ms.push_back(cus.seconds * 1e3);
      }
    }
    auto d = Gpu()->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->nan_test + d->nan_ref + d->inf_test + d->inf_ref, 0);
    EXPECT_LT(d->rel_l2, testing::kCustomVsReferenceMaxRelL2);
    std::sort(ref_ms.begin(), ref_ms.end());
    std::sort(cus_ms.begin(), cus_ms.end());
    const double ref_med = ref_ms[ref_ms.size() / 2], cus_med = cus_ms[cus_ms.size() / 2];
    // Q·Kᵀ over 576 dims and P·V over 512, every query row against its request's whole KV.
    const double flops = 2.0 * v.total_kv_len * v.shape.draft * v.shape.heads *
                         (kernels::kHeadDimQK + kernels::kHeadDimV);
    std::printf(
        "warm B%d T%d H%d page%d prefix%lld: reference %.3f ms (%.0f TFLOP/s), custom %.3f ms "
        "(%.0f TFLOP/s), custom %.1fx faster; custom vs reference rel_l2 %.3g\n",
        sh.batch, sh.draft, sh.heads, sh.page, static_cast<long long>(sh.prefix), ref_med,
        flops / ref_med * 1e-9, cus_med, flops / cus_med * 1e-9, ref_med / cus_med, d->rel_l2);
  }
}

// Inputs the GPU reads where they are (a CUDA IPC region's q and a shared pool): prepared with
// detach, the bundle is a snapshot (q and the named pages copied by one gather launch), so
// overwriting the client's memory afterwards changes neither path's output.
TEST(CudaEngine, ADetachedBundleOfDeviceInputsIsASnapshot) {
  REQUIRE_GPU_ENGINE();
  for (int page : {1, 16, 64}) {
    SCOPED_TRACE(::testing::Message() << "page " << page);
    RandomBundleSpec s;
    s.batch = 3;
    s.draft = 5;
    s.heads = 16;
    s.page_size = page;
    s.prefix = 301;
    s.seed = 900 + page;
    RandomBundle rb(s);
    const BundleView host = rb.view();
    PathOutput want_ref, want_cus;
    {
      auto pb = Gpu()->Prepare(host, false);
      ASSERT_TRUE(pb.ok()) << pb.status();
      ASSERT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
      ASSERT_TRUE(Gpu()->Fetch(Path::kReference, **pb, &want_ref).ok());
      ASSERT_TRUE(Gpu()->Run(Path::kCustom, **pb).ok());
      ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, **pb, &want_cus).ok());
    }
    const size_t q_bytes = size_t(host.q_elems()) * 2, kv_bytes = size_t(host.kv_elems()) * 2;
    void* q = nullptr;
    void* kv = nullptr;
    ASSERT_EQ(cudaMalloc(&q, q_bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&kv, kv_bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(q, host.q, q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(kv, host.kv_pool, kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    BundleView v = host;
    v.q = static_cast<const uint16_t*>(q);
    v.kv_pool = static_cast<const uint16_t*>(kv);
    v.q_device = 0;
    v.kv_pool_device = 0;
    v.kv_pool_shared = true;
    auto pb = Gpu()->Prepare(v, /*detach=*/true);
    ASSERT_TRUE(pb.ok()) << pb.status();
    PathOutput ref, cus;
    ASSERT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
    ASSERT_TRUE(Gpu()->Fetch(Path::kReference, **pb, &ref).ok());
    // The response is out: the client reuses its memory at once (NaN everywhere), and the
    // deferred path runs after that.
    ASSERT_EQ(cudaMemset(q, 0xff, q_bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(kv, 0xff, kv_bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(Gpu()->Run(Path::kCustom, **pb).ok());
    ASSERT_TRUE(Gpu()->Fetch(Path::kCustom, **pb, &cus).ok());
    EXPECT_TRUE(ref.o == want_ref.o);
    EXPECT_TRUE(cus.o == want_cus.o);
    pb->reset();
    cudaFree(q);
    cudaFree(kv);
  }
}

// A bundle's tensors copied into device memory of their own, as a CUDA IPC or VMM region holds
// them: q, the pool, and with `indices` the page ids and mask too (then checked on the device).
class DeviceCopy {
 public:
  DeviceCopy(const BundleView& host, bool indices) : view_(host) {
    view_.q = Copy(host.q, size_t(host.q_elems()) * 2);
    view_.kv_pool = Copy(host.kv_pool, size_t(host.kv_elems()) * 2);
    view_.q_device = view_.kv_pool_device = 0;
    view_.kv_pool_shared = true;
    if (indices) {
      view_.kv_indices = Copy(host.kv_indices, size_t(host.shape.num_indices) * 4);
      view_.tree_mask = Copy(host.tree_mask, size_t(host.mask_bytes()));
      view_.indices_device = 0;
    }
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy() {
    for (void* p : owned_) cudaFree(p);
  }
  const BundleView& view() const { return view_; }
  // Writes `bytes` bytes at byte `at` of the device copy of `field` (a pointer of view()).
  void Poke(const void* field, size_t at, const void* bytes, size_t n) {
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(const_cast<void*>(field)) + at, bytes, n,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }

 private:
  template <typename T>
  const T* Copy(const T* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(bytes, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(d);
    return static_cast<const T*>(d);
  }
  BundleView view_;
  std::vector<void*> owned_;
};

struct Served {
  absl::Status checks;
  PathOutput reference, custom;
};

// Both served paths on `v`, as a call runs them, and the outcome of the device checks.
Served ServeBoth(const BundleView& v, bool detach) {
  Served out;
  auto pb = Gpu()->Prepare(v, detach);
  EXPECT_TRUE(pb.ok()) << pb.status();
  if (!pb.ok()) return out;
  EXPECT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
  EXPECT_TRUE(Gpu()->Fetch(Path::kReference, **pb, &out.reference).ok());
  EXPECT_TRUE(Gpu()->Run(Path::kCustom, **pb).ok());
  EXPECT_TRUE(Gpu()->Fetch(Path::kCustom, **pb, &out.custom).ok());
  out.checks = Gpu()->InputChecks(**pb);
  return out;
}

// Page ids and masks in device memory are checked there as they are copied (no copy of them to
// the host): a clean bundle serves exactly what the host-checked one does, in place and as a
// snapshot; a bad page id (past the pool, negative) or mask byte fails the checks with the error
// ValidateBundle gives for the same bytes on the host, the first bad entry named, while the paths
// read page 0 instead (nothing outside the pool); the engine then serves the next bundle.
TEST(CudaEngine, PageIdsAndMasksInDeviceMemoryAreCheckedOnTheDevice) {
  REQUIRE_GPU_ENGINE();
  for (MaskFormat format : {MaskFormat::kBytes, MaskFormat::kBits}) {
    for (int page : {1, 64}) {
      for (bool detach : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "page " << page << " detach " << detach << " bits "
                                          << (format == MaskFormat::kBits));
        RandomBundleSpec s;
        s.batch = 3;
        s.draft = 5;  // packed rows have pad bits
        s.heads = 16;
        s.page_size = page;
        s.prefix = 203;
        s.mask_format = format;
        s.seed = 4100 + page + detach;
        RandomBundle rb(s);
        const BundleView host = rb.view();
        const Served want = ServeBoth(host, detach);
        ASSERT_TRUE(want.checks.ok());
        {
          DeviceCopy clean(host, /*indices=*/true);
          const Served got = ServeBoth(clean.view(), detach);
          EXPECT_TRUE(got.checks.ok()) << got.checks;
          EXPECT_TRUE(got.reference.o == want.reference.o);
          EXPECT_TRUE(got.custom.o == want.custom.o);
          // Page ids on the device are checked as they are copied for a pool read there: with
          // the pool said to be elsewhere, the bundle is refused, naming the field.
          BundleView split = clean.view();
          split.kv_pool_device = -1;
          auto refused = Gpu()->Prepare(split, detach);
          ASSERT_FALSE(refused.ok());
          EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_NE(refused.status().message().find("kv_indices"), std::string::npos)
              << refused.status();
        }
        const int64_t n = host.shape.num_indices;
        // Two bad page ids: the first is named. And one bad mask entry.
        for (auto [at, page_id] :
             {std::pair<int64_t, int32_t>{n - 2, int32_t(host.shape.num_pages)},
              std::pair<int64_t, int32_t>{n / 2, -1}}) {
          SCOPED_TRACE(::testing::Message() << "kv_indices[" << at << "] = " << page_id);
          DeviceCopy bad(host, true);
          std::vector<int32_t> ids(rb.kv_indices);
          ids[at] = page_id;
          ids[n - 1] = 1 << 30;
          bad.Poke(bad.view().kv_indices, 0, ids.data(), ids.size() * 4);
          BundleView on_host = host;
          on_host.kv_indices = ids.data();
          const absl::Status host_says = ValidateBundle(on_host);
          const Served got = ServeBoth(bad.view(), detach);
          EXPECT_EQ(got.checks, host_says);
          EXPECT_NE(got.checks.message().find(absl::StrCat("kv_indices[", at, "]")),
                    std::string::npos)
              << got.checks;
        }
        {
          DeviceCopy bad(host, true);
          std::vector<uint8_t> mask(rb.tree_mask);
          const int64_t row_bytes = kernels::MaskRowBytes(format, s.draft);
          const int64_t at = 7 * row_bytes + row_bytes - 1;  // request 1, row 2, last byte
          mask[at] = format == MaskFormat::kBytes ? 2 : static_cast<uint8_t>(mask[at] | 0x80);
          bad.Poke(bad.view().tree_mask, 0, mask.data(), mask.size());
          BundleView on_host = host;
          on_host.tree_mask = mask.data();
          const absl::Status host_says = ValidateBundle(on_host);
          ASSERT_FALSE(host_says.ok());
          const Served got = ServeBoth(bad.view(), detach);
          EXPECT_EQ(got.checks, host_says);
        }
        DeviceCopy again(host, true);
        const Served next = ServeBoth(again.view(), detach);
        EXPECT_TRUE(next.checks.ok()) << next.checks;
        EXPECT_TRUE(next.custom.o == want.custom.o);
      }
    }
  }
}

// Calls that name the same layout (BundleView::layout_key) read it once per lane: after the first
// call on each lane, page ids changed in device memory are not read again for that key (those
// calls serve exactly the first read's outputs, and a bad page id read once is reported by each);
// a new key, a key of 0 or other tensors read them afresh.
TEST(CudaEngine, ALayoutKeyIsReadOncePerLane) {
  REQUIRE_GPU_ENGINE();
  constexpr int kLanes = 4;  // CudaEngineOptions::lanes_per_device
  for (bool detach : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "detach " << detach);
    RandomBundleSpec s;
    s.batch = 3;
    s.draft = 7;
    s.heads = 16;
    s.page_size = 16;
    s.prefix = 301;
    s.seed = 4200 + detach;
    RandomBundle rb(s);
    const BundleView host = rb.view();
    const Served first = ServeBoth(host, detach);
    std::vector<int32_t> reversed(rb.kv_indices.rbegin(), rb.kv_indices.rend());
    BundleView moved_host = host;
    moved_host.kv_indices = reversed.data();
    const Served moved = ServeBoth(moved_host, detach);
    ASSERT_FALSE(moved.custom.o == first.custom.o);  // the test can tell the two apart

    DeviceCopy dev(host, /*indices=*/true);
    BundleView keyed = dev.view();
    keyed.layout_key = (uint64_t{7} << 32) + 1 + detach;
    for (int i = 0; i < kLanes; ++i) {
      const Served got = ServeBoth(keyed, detach);
      EXPECT_TRUE(got.checks.ok()) << got.checks;
      EXPECT_TRUE(got.custom.o == first.custom.o);
    }
    dev.Poke(keyed.kv_indices, 0, reversed.data(), reversed.size() * 4);
    for (int i = 0; i < 2 * kLanes; ++i) {  // every lane serves the layout it read
      const Served got = ServeBoth(keyed, detach);
      EXPECT_TRUE(got.reference.o == first.reference.o) << "call " << i;
      EXPECT_TRUE(got.custom.o == first.custom.o) << "call " << i;
    }
    BundleView unkeyed = keyed;
    unkeyed.layout_key = 0;
    BundleView next = keyed;
    next.layout_key += 16;
    for (const BundleView* v : {&unkeyed, &next}) {
      const Served got = ServeBoth(*v, detach);
      EXPECT_TRUE(got.reference.o == moved.reference.o);
      EXPECT_TRUE(got.custom.o == moved.custom.o);
    }
    {  // the same key over other tensors
      DeviceCopy other(moved_host, true);
      BundleView same_key = other.view();
      same_key.layout_key = keyed.layout_key;
      EXPECT_TRUE(ServeBoth(same_key, detach).custom.o == moved.custom.o);
    }
    // A bad page id read under a key fails every call of that key, named as on the host.
    std::vector<int32_t> bad_ids(rb.kv_indices);
    bad_ids[5] = int32_t(host.shape.num_pages) + 3;
    BundleView bad_host = host;
    bad_host.kv_indices = bad_ids.data();
    const absl::Status host_says = ValidateBundle(bad_host);
    ASSERT_FALSE(host_says.ok());
    DeviceCopy bad(bad_host, true);
    BundleView bad_keyed = bad.view();
    bad_keyed.layout_key = keyed.layout_key + 32;
    for (int i = 0; i < kLanes + 1; ++i) {
      if (i == kLanes) bad.Poke(bad_keyed.kv_indices, 0, rb.kv_indices.data(), bad_ids.size() * 4);
      EXPECT_EQ(ServeBoth(bad_keyed, detach).checks, host_says) << "call " << i;
    }
  }
}

// Many gRPC threads share one engine: every thread's results equal the single-threaded ones.
TEST(CudaEngine, ConcurrentCallsGiveTheSameResults) {
  REQUIRE_GPU_ENGINE();
  constexpr int kBundles = 6, kThreads = 8, kRounds = 3;
  std::vector<std::unique_ptr<RandomBundle>> bundles;
  std::vector<PathOutput> expected(kBundles);
  for (int i = 0; i < kBundles; ++i) {
    RandomBundleSpec s;
    s.batch = 1 + i % 3;
    s.draft = 1 + 7 * i;
    s.heads = i % 2 ? 16 : 128;
    s.page_size = 1 << ((i % 4) * 2);
    s.prefix = 33 + 301 * i;
    s.seed = 500 + i;
    bundles.push_back(std::make_unique<RandomBundle>(s));
    auto pb = Gpu()->Prepare(bundles.back()->view(), false);
    ASSERT_TRUE(pb.ok()) << pb.status();
    ASSERT_TRUE(Gpu()->Run(Path::kReference, **pb).ok());
    ASSERT_TRUE(Gpu()->Fetch(Path::kReference, **pb, &expected[i]).ok());
  }
  std::vector<int> mismatches(kThreads, 0), errors(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const int i = (t + round) % kBundles;
        auto pb = Gpu()->Prepare(bundles[i]->view(), false);
        if (!pb.ok()) {
          ++errors[t];
          continue;
        }
        PathOutput ref;
        if (!Gpu()->Run(Path::kReference, **pb).ok() ||
            !Gpu()->Fetch(Path::kReference, **pb, &ref).ok()) {
          ++errors[t];
          continue;
        }
        if (ref.o != expected[i].o) ++mismatches[t];
        // The shadow side as the server runs it: custom, then the device comparison.
        if (Gpu()->Run(Path::kCustom, **pb).ok()) {
          auto d = Gpu()->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
          if (!d.ok() || d->nan_test + d->nan_ref > 0) ++errors[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], 0) << "thread " << t;
    EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  }
}

}  // namespace
}  // namespace verifyd
