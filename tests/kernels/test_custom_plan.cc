// How the fused kernel plans a launch (tile shapes, KV split, workspace), and the launcher's
// refusals that need no device. Runs without a GPU.

#include <cstdlib>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/custom_plan.h"
#include "kernels/custom/custom_schedule.h"

namespace verifyd::kernels {
namespace {

VerifyProblem Problem(int batch, int draft, int heads, int64_t prefix) {
  VerifyProblem p;
  p.shape.batch = batch;
  p.shape.draft = draft;
  p.shape.heads = heads;
  p.shape.page_size = 64;
  p.shape.num_pages = 1;
  p.max_kv_len = prefix + draft;
  p.total_kv_len = p.max_kv_len * batch;
  return p;
}

// One shipped schedule per architecture and pool type: kAuto, v5t, v3e and the sm_120 tiles ship;
// every schedule has a name of its own (verifyd-bench's paths are "custom-" + it); only v3e reads
// e4m3 codes and only v5t makes the op's checks; the shipped launcher refuses the others.
TEST(CustomSchedules, ThreeShipAndEachHasItsOwnName) {
  std::set<std::string> names, shipped;
  for (int i = 0; i <= static_cast<int>(CustomSchedule::kMmaSync); ++i) {
    const auto s = static_cast<CustomSchedule>(i);
    EXPECT_TRUE(names.insert(ScheduleName(s)).second) << ScheduleName(s) << " named twice";
    if (ScheduleShipped(s)) shipped.insert(ScheduleName(s));
    EXPECT_EQ(ScheduleReadsE4m3(s), s == CustomSchedule::kV3e) << ScheduleName(s);
    EXPECT_EQ(ScheduleChecksInKernel(s), s == CustomSchedule::kV5t) << ScheduleName(s);
    if (!ScheduleShipped(s)) {
      EXPECT_EQ(LaunchCustomWith(VerifyProblem{}, CustomConfig{}, s, nullptr, 0, nullptr),
                cudaErrorNotSupported)
          << ScheduleName(s) << " launched by the shipped library";
    }
  }
  EXPECT_EQ(shipped, (std::set<std::string>{"auto", "v5t", "v3e", "sm120"}));
  EXPECT_EQ(names.size(), 12u);
}

TEST(CustomPlan, TileShapesFitTheirTargets) {
  EXPECT_LE(HopperTileShape().smem_bytes, size_t{232448});  // H100/H200 opt-in limit per block
  EXPECT_LE(Sm120TileShape().smem_bytes, size_t{101376});   // sm_120 opt-in limit per block
}

TEST(CustomPlan, LongPrefixSmallBatchFillsTheMachine) {
  // (B, T, H, prefix) of the benchmark whose request count alone leaves SMs idle.
  struct Shape {
    int b, t, h;
    int64_t prefix;
  };
  for (Shape s : {Shape{8, 16, 8, 4096}, Shape{16, 8, 16, 32768}, Shape{4, 16, 64, 8192},
                  Shape{64, 4, 16, 2048}, Shape{32, 16, 8, 8192}}) {
    const CustomPlan plan = PlanCustom(Problem(s.b, s.t, s.h, s.prefix), false, 132, 1, 0);
    const int64_t ctas = int64_t{s.b} * plan.row_blocks * plan.splits;
    EXPECT_GE(ctas, 120) << s.b << "x" << s.t << "x" << s.h << " prefix " << s.prefix;
    EXPECT_LE(ctas, 132) << "a second, nearly empty wave";
    EXPECT_GT(plan.workspace_bytes, 0u);
  }
}

TEST(CustomPlan, EnoughRowBlocksNeedNoSplit) {
  const CustomPlan plan = PlanCustom(Problem(1, 1024, 8, 2048), false, 132, 1, 0);
  EXPECT_EQ(plan.row_blocks, 128);
  EXPECT_EQ(plan.splits, 1);
  EXPECT_EQ(plan.workspace_bytes, 0u);
}

TEST(CustomPlan, ForcedSplitsClampToTheTiles) {
  const CustomPlan plan = PlanCustom(Problem(2, 3, 8, 10), false, 132, 1, 9);
  EXPECT_EQ(plan.max_tiles, 1);
  EXPECT_EQ(plan.splits, 1);
  const CustomPlan small = PlanCustom(Problem(2, 3, 8, 1000), true, 132, 2, 5);
  EXPECT_EQ(small.splits, 5);
  EXPECT_EQ(small.tiles_per_split * 5 >= small.max_tiles, true);
  EXPECT_GE(small.workspace_bytes, size_t{5} * 2 * 3 * 8 * (512 + 1) * 4);
}

TEST(CustomPlan, EverySplitHasWork) {
  for (int force = 1; force <= 40; ++force) {
    const CustomPlan plan = PlanCustom(Problem(1, 5, 8, 1900), false, 132, 1, force);
    EXPECT_LT((plan.splits - 1) * plan.tiles_per_split, plan.max_tiles) << force;
    EXPECT_GE(plan.splits * plan.tiles_per_split, plan.max_tiles) << force;
  }
}

TEST(CustomConfigEnv, ForcesTheSm120Tiles) {
  ::setenv("VERIFYD_FORCE_SM120_CONFIG", "1", 1);
  EXPECT_TRUE(CustomConfigFromEnv().small_smem);
  ::setenv("VERIFYD_FORCE_SM120_CONFIG", "0", 1);
  EXPECT_FALSE(CustomConfigFromEnv().small_smem);
  ::unsetenv("VERIFYD_FORCE_SM120_CONFIG");
  EXPECT_FALSE(CustomConfigFromEnv().small_smem);
}

TEST(CustomLaunch, RefusesAnUnsupportedShapeBeforeTouchingTheDevice) {
  VerifyProblem p = Problem(1, 4, 8, 100);
  p.shape.heads = 0;
  EXPECT_EQ(LaunchCustom(p, CustomConfig{}, nullptr, 0, nullptr), cudaErrorInvalidValue);
  p = Problem(1, 4, 8, 100);
  p.shape.page_size = 3;
  EXPECT_EQ(LaunchCustom(p, CustomConfig{}, nullptr, 0, nullptr), cudaErrorInvalidValue);
  p = Problem(1, 4, 8, 100);
  p.max_kv_len = 2;  // shorter than the draft tail
  EXPECT_EQ(LaunchCustom(p, CustomConfig{}, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace verifyd::kernels
