// Every golden case (tests/data/golden/*.safetensors) through the fused kernel in both tile
// configurations, against the stored fp64 answer rounded to bf16. An e4m3 case reaches the kernel
// as the engines give it one: its named pages in bf16 (exact), kv_scale on the logits, and o
// times kv_scale afterwards (DequantizedBundle). Skips without a GPU.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/variants/custom_variants.h"
#include "src/bundle/dequantized_bundle.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/io/bundle_file.h"
#include "tests/common/gpu_test_support.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;

// VERIFYD_TEST_DATA in the environment overrides the build tree's path (packed runs).
fs::path TestData() {
  const char* env = std::getenv("VERIFYD_TEST_DATA");
  return env != nullptr && *env != '\0' ? fs::path(env) : fs::path(VERIFYD_TEST_DATA);
}

std::vector<std::string> GoldenCases() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(TestData() / "golden", ec)) {
    if (e.path().extension() == ".safetensors") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// One launch of `schedule` on the uploaded bundle, its outputs poisoned before and fetched after.
void LaunchAndFetch(testing::DeviceBundle& dev, const kernels::CustomConfig& c,
                    kernels::CustomSchedule schedule, std::vector<uint16_t>* o,
                    std::vector<float>* lse) {
  ASSERT_EQ(dev.Poison(), cudaSuccess);
  const size_t ws_bytes = kernels::CustomVariantWorkspaceBytes(dev.problem, c, schedule);
  testing::DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
  ASSERT_EQ(
      kernels::LaunchCustomVariant(dev.problem, c, schedule, ws.get<void>(), ws_bytes, nullptr),
      cudaSuccess);
  o->resize(dev.o.bytes() / 2);
  lse->resize(dev.lse.bytes() / 4);
  ASSERT_EQ(cudaMemcpy(o->data(), dev.o.get<void>(), o->size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse->data(), dev.lse.get<void>(), lse->size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
}

class CustomKernelGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CustomKernelGolden, MatchesTheStoredOracle) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  auto file = LoadBundleFile((TestData() / "golden" / (GetParam() + ".safetensors")).string());
  ASSERT_TRUE(file.ok()) << file.status();
  BundleView sent = file->view;
  ASSERT_TRUE(ValidateBundle(sent).ok());
  ASSERT_NE(file->o_expected, nullptr);
  ASSERT_NE(file->lse_expected, nullptr);
  std::unique_ptr<const DequantizedBundle> bf16;
  if (sent.shape.kv_dtype == kernels::KvDtype::kE4m3) {
    bf16 = std::make_unique<const DequantizedBundle>(sent);
  }
  const BundleView& v = bf16 ? bf16->view() : sent;  // what the kernel reads
  const float* o_exp = file->o_expected->as<float>();
  std::vector<float> ref(o_exp, o_exp + v.o_elems());
  for (float& x : ref) x = RoundToBf16(x);

  testing::DeviceBundle dev;
  ASSERT_EQ(dev.Upload(v), cudaSuccess);
  // The shipped choice in both tile configurations, v5t by name, and the bench-only schedules of
  // the Hopper tiles (custom_schedule.h).
  struct Variant {
    const char* name;
    bool small;
    kernels::CustomSchedule schedule;
  };
  for (const Variant& var : {Variant{"hopper", false, kernels::CustomSchedule::kAuto},
                             Variant{"hopper_v3", false, kernels::CustomSchedule::kV3},
                             Variant{"hopper_v4", false, kernels::CustomSchedule::kV4},
                             Variant{"hopper_v4k", false, kernels::CustomSchedule::kV4SplitK},
                             Variant{"hopper_v4c", false, kernels::CustomSchedule::kV4TwoChain},
                             Variant{"hopper_v5", false, kernels::CustomSchedule::kV5},
                             Variant{"hopper_v5s", false, kernels::CustomSchedule::kV5s},
                             Variant{"hopper_v5t", false, kernels::CustomSchedule::kV5t},
                             Variant{"sm120", true, kernels::CustomSchedule::kAuto}}) {
    const bool small = var.small;
    SCOPED_TRACE(var.name);
    kernels::CustomConfig c;
    c.small_smem = small;
    std::vector<uint16_t> o;
    std::vector<float> lse;
    ASSERT_NO_FATAL_FAILURE(LaunchAndFetch(dev, c, var.schedule, &o, &lse));
    EXPECT_TRUE(dev.o.GuardIntact());
    EXPECT_TRUE(dev.lse.GuardIntact());
    // An e4m3 case's kv_scale is on o before its rounding (VerifyProblem::o_scale, from the
    // dequantised view), as the CUDA engine puts it: one rounding, as the stored answer's.
    const DiffStats d = CompareBf16ToF32(o.data(), ref.data(), static_cast<int64_t>(o.size()),
                                         lse.data(), file->lse_expected->as<float>(),
                                         static_cast<int64_t>(lse.size()), Tolerance{});
    std::printf("[ metrics  ] golden=%s tiles=%s rel_l2=%.3e max_abs=%.3e lse_max_abs=%.3e\n",
                GetParam().c_str(), var.name, d.rel_l2, d.max_abs, d.lse_max_abs);
    EXPECT_EQ(d.nan_test, 0);
    EXPECT_LE(d.rel_l2, testing::kCustomMaxRelL2);
    EXPECT_LE(d.max_abs, testing::kMaxAbs);
    EXPECT_LE(d.lse_max_abs, testing::kLseMaxAbs);
  }
}

// v3e, the kernel that reads an e4m3 pool's codes itself: every e4m3 golden case on the pool as
// stored, kv_scale applied by the kernel (on the logits and on o before its rounding), against
// the stored fp64 answer.
TEST_P(CustomKernelGolden, AnE4m3CaseThroughTheKernelThatReadsTheCodes) {
  const std::string why = testing::NoGpuReason();
  if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
  auto file = LoadBundleFile((TestData() / "golden" / (GetParam() + ".safetensors")).string());
  ASSERT_TRUE(file.ok()) << file.status();
  BundleView& v = file->view;
  if (v.shape.kv_dtype != kernels::KvDtype::kE4m3) GTEST_SKIP() << "a bf16 case";
  // ValidateBundle fills the lengths the launch plans with (max_kv_len, total_kv_len).
  ASSERT_TRUE(ValidateBundle(v).ok());
  const float* o_exp = file->o_expected->as<float>();
  std::vector<float> ref(o_exp, o_exp + v.o_elems());
  for (float& x : ref) x = RoundToBf16(x);
  testing::DeviceBundle dev;
  ASSERT_EQ(dev.Upload(v), cudaSuccess);
  kernels::CustomConfig c;
  for (int splits : {0, 1, 3}) {
    SCOPED_TRACE(splits);
    c.force_splits = splits;
    std::vector<uint16_t> o;
    std::vector<float> lse;
    ASSERT_NO_FATAL_FAILURE(LaunchAndFetch(dev, c, kernels::CustomSchedule::kV3e, &o, &lse));
    const DiffStats d = CompareBf16ToF32(o.data(), ref.data(), static_cast<int64_t>(o.size()),
                                         lse.data(), file->lse_expected->as<float>(),
                                         static_cast<int64_t>(lse.size()), Tolerance{});
    std::printf(
        "[ metrics  ] golden=%s tiles=hopper_v3e splits=%d rel_l2=%.3e max_abs=%.3e "
        "lse_max_abs=%.3e\n",
        GetParam().c_str(), splits, d.rel_l2, d.max_abs, d.lse_max_abs);
    EXPECT_EQ(d.nan_test, 0);
    EXPECT_LE(d.rel_l2, testing::kCustomMaxRelL2);
    EXPECT_LE(d.max_abs, testing::kMaxAbs);
    EXPECT_LE(d.lse_max_abs, testing::kLseMaxAbs);
  }
}

// An e4m3 problem reaches only v3e (named, or kAuto's choice), and v3e only an e4m3 problem with a
// positive finite scale: any other pairing would read the pool as the wrong type. Refused before
// anything touches a device, so this runs without a GPU.
TEST(CustomKernelE4m3, ThePoolsTypeAndTheScheduleMustAgree) {
  kernels::VerifyProblem p = testing::TinyProblem();
  p.shape.kv_dtype = kernels::KvDtype::kE4m3;
  p.kv_scale = 0.37f;
  const kernels::CustomConfig c;
  for (auto schedule : {kernels::CustomSchedule::kV5t, kernels::CustomSchedule::kSmallTiles,
                        kernels::CustomSchedule::kV3, kernels::CustomSchedule::kV5}) {
    EXPECT_EQ(kernels::LaunchCustomVariant(p, c, schedule, nullptr, 0, nullptr),
              cudaErrorInvalidValue)
        << "an e4m3 pool read as bf16 by " << kernels::ScheduleName(schedule);
  }
  EXPECT_EQ(kernels::LaunchCustomWith(p, c, kernels::CustomSchedule::kV5t, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  for (float bad : {0.f, -1.f, NAN, INFINITY}) {
    p.kv_scale = bad;
    for (auto schedule : {kernels::CustomSchedule::kV3e, kernels::CustomSchedule::kAuto}) {
      EXPECT_EQ(kernels::LaunchCustomWith(p, c, schedule, nullptr, 0, nullptr),
                cudaErrorInvalidValue)
          << "kv_scale " << bad << " under " << kernels::ScheduleName(schedule);
    }
  }
  p.shape.kv_dtype = kernels::KvDtype::kBf16;
  p.kv_scale = 1.f;
  EXPECT_EQ(kernels::LaunchCustomWith(p, c, kernels::CustomSchedule::kV3e, nullptr, 0, nullptr),
            cudaErrorInvalidValue)
      << "a bf16 pool read as e4m3 codes";
}

INSTANTIATE_TEST_SUITE_P(Golden, CustomKernelGolden, ::testing::ValuesIn(GoldenCases()),
                         [](const auto& i) { return i.param; });

}  // namespace
}  // namespace verifyd
