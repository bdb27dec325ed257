// The in-process op's checks made inside the shipped kernel (CustomCallChecks): the verdict of
// good and bad calls, unsplit and split (where the combine's last block writes it), the words left
// clear for the next call, and the pairings a launch refuses. The refusals need no GPU; the rest
// skips without one.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
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
using kernels::CustomSchedule;
using testing::DeviceBuffer;
using testing::DeviceBundle;

// Checks go with the shipped schedule only (kAuto or v5t by name, on the Hopper tiles), never
// beside `skip`, and always with a failed byte: refused before anything touches a device.
TEST(CustomKernelChecks, ALaunchWithChecksRefusesEveryOtherPairing) {
  const kernels::VerifyProblem p = testing::TinyProblem();
  unsigned* words = reinterpret_cast<unsigned*>(uintptr_t{0x1000});  // never dereferenced
  uint8_t* failed = reinterpret_cast<uint8_t*>(uintptr_t{0x2000});
  CustomConfig c;
  c.checks.words = words;
  c.checks.failed = failed;
  for (auto schedule :
       {CustomSchedule::kV3e, CustomSchedule::kSmallTiles, CustomSchedule::kV3, CustomSchedule::kV5,
        CustomSchedule::kV5s, CustomSchedule::kV4, CustomSchedule::kMmaSync}) {
    EXPECT_EQ(kernels::LaunchCustomVariant(p, c, schedule, nullptr, 0, nullptr),
              cudaErrorInvalidValue)
        << "checks asked of " << kernels::ScheduleName(schedule);
  }
  CustomConfig small = c;
  small.small_smem = true;
  EXPECT_EQ(kernels::LaunchCustom(p, small, nullptr, 0, nullptr), cudaErrorInvalidValue);
  CustomConfig both = c;
  both.skip = words;
  EXPECT_EQ(kernels::LaunchCustom(p, both, nullptr, 0, nullptr), cudaErrorInvalidValue);
  CustomConfig nowhere = c;
  nowhere.checks.failed = nullptr;
  EXPECT_EQ(kernels::LaunchCustom(p, nowhere, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

class CustomKernelChecksGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = testing::NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << "GPU kernel test skipped: " << why;
    RandomBundleSpec spec;
    spec.batch = 3;
    spec.draft = 5;
    spec.heads = 16;
    spec.prefix_lens = {700, 333, 1025};  // off the tile: draft blocks start inside tiles
    spec.page_size = 16;
    spec.seed = 4242;
    bundle_ = std::make_unique<RandomBundle>(spec);
    ASSERT_EQ(dev_.Upload(bundle_->view()), cudaSuccess);
    ASSERT_TRUE(kernels::CustomChecksInKernel(dev_.problem, {}))
        << "the shipped schedule makes the checks on this device";
    ASSERT_EQ(words_.Fill(0), cudaSuccess);
    ASSERT_EQ(failed_.Fill(0xEE), cudaSuccess);
    ASSERT_EQ(serve_.Fill(1), cudaSuccess);
  }

  // One call with the checks at `splits` (0: the planner's); returns the failed byte, and
  // expects the verdict words clear afterwards.
  uint8_t Call(int splits) {
    CustomConfig c;
    c.force_splits = splits;
    c.checks.words = words_.get<unsigned>();
    c.checks.failed = failed_.get<uint8_t>();
    c.checks.serve = serve_.get<uint8_t>();
    c.checks.max_indices = dev_.problem.shape.num_indices;
    c.checks.max_kv_len = dev_.problem.max_kv_len;
    const size_t ws_bytes = kernels::CustomWorkspaceBytes(dev_.problem, c);
    DeviceBuffer ws(std::max<size_t>(ws_bytes, 16));
    EXPECT_EQ(kernels::LaunchCustom(dev_.problem, c, ws.get<void>(), ws_bytes, nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    uint8_t failed = 0xEE;
    unsigned words[2] = {7, 7};
    EXPECT_EQ(cudaMemcpy(&failed, failed_.get<void>(), 1, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(words, words_.get<void>(), sizeof(words), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(words[0], 0u) << "the verdict is cleared for the next call";
    EXPECT_EQ(words[1], 0u) << "the CTA count is cleared for the next call";
    return failed;
  }

  // The call's o against the fp64 oracle of every row (the bundle is small).
  void ExpectMatchesOracle() {
    const BundleView& v = bundle_->view();
    std::vector<uint16_t> o(v.o_elems());
    std::vector<float> lse(v.lse_elems());
    ASSERT_EQ(cudaMemcpy(o.data(), dev_.o.get<void>(), o.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), dev_.lse.get<void>(), lse.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    const int H = v.shape.heads, T = v.shape.draft;
    std::vector<double> ref_o(o.size()), ref_lse(lse.size());
    for (int b = 0; b < v.shape.batch; ++b) {
      for (int t = 0; t < T; ++t) {
        const int64_t r0 = (int64_t{b} * T + t) * H;
        OracleTokenHeads(v, b, t, 0, H, ref_o.data() + r0 * kernels::kHeadDimV,
                         ref_lse.data() + r0);
      }
    }
    std::vector<float> want_o(o.size()), want_lse(lse.size());
    for (size_t i = 0; i < o.size(); ++i) want_o[i] = RoundToBf16(static_cast<float>(ref_o[i]));
    for (size_t i = 0; i < lse.size(); ++i) want_lse[i] = static_cast<float>(ref_lse[i]);
    const DiffStats d =
        CompareBf16ToF32(o.data(), want_o.data(), static_cast<int64_t>(o.size()), lse.data(),
                         want_lse.data(), static_cast<int64_t>(lse.size()), Tolerance{});
    EXPECT_EQ(d.nan_test, 0);
    EXPECT_LE(d.rel_l2, testing::kCustomMaxRelL2);
    EXPECT_LE(d.lse_max_abs, testing::kLseMaxAbs);
  }

  template <class T>
  void Poke(DeviceBuffer& buf, int64_t i, T value) {
    ASSERT_EQ(cudaMemcpy(buf.get<T>() + i, &value, sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <class T>
  T Peek(DeviceBuffer& buf, int64_t i) {
    T value{};
    EXPECT_EQ(cudaMemcpy(&value, buf.get<T>() + i, sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return value;
  }

  std::unique_ptr<RandomBundle> bundle_;
  DeviceBundle dev_;
  DeviceBuffer words_{2 * sizeof(unsigned)}, failed_{1}, serve_{1};
};

// Unsplit (the last CTA writes the verdict) and split (the combine's last block does): a good
// call passes and matches the oracle; each bad input fails it; the next good call passes again.
TEST_F(CustomKernelChecksGpu, EachBadInputFailsTheCallAndTheNextGoodOnePasses) {
  const BundleView& v = bundle_->view();
  const int64_t last_page = v.kv_indptr[v.shape.batch] - 1;
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    ASSERT_EQ(dev_.Poison(), cudaSuccess);
    EXPECT_EQ(Call(splits), 0);
    ExpectMatchesOracle();

    const int32_t page = Peek<int32_t>(dev_.kv_indices, last_page);
    Poke<int32_t>(dev_.kv_indices, last_page, static_cast<int32_t>(v.shape.num_pages));
    EXPECT_EQ(Call(splits), 1) << "the last request's last page id past the pool";
    Poke<int32_t>(dev_.kv_indices, last_page, -3);
    EXPECT_EQ(Call(splits), 1) << "a negative page id";
    Poke<int32_t>(dev_.kv_indices, last_page, page);

    const int32_t len = Peek<int32_t>(dev_.kv_lens, 1);
    Poke<int32_t>(dev_.kv_lens, 1, static_cast<int32_t>(dev_.problem.max_kv_len + 1));
    EXPECT_EQ(Call(splits), 1) << "a kv_len past max_kv_len";
    Poke<int32_t>(dev_.kv_lens, 1, v.shape.draft - 1);
    EXPECT_EQ(Call(splits), 1) << "a kv_len shorter than the draft";
    Poke<int32_t>(dev_.kv_lens, 1, len);

    const int32_t mid = Peek<int32_t>(dev_.kv_indptr, 2);
    Poke<int32_t>(dev_.kv_indptr, 2, Peek<int32_t>(dev_.kv_indptr, 1) - 1);
    EXPECT_EQ(Call(splits), 1) << "a falling kv_indptr";
    Poke<int32_t>(dev_.kv_indptr, 2, mid);

    const int64_t mask_at = (int64_t{2} * v.shape.draft + 3) * v.shape.draft + 1;
    const uint8_t m = Peek<uint8_t>(dev_.tree_mask, mask_at);
    Poke<uint8_t>(dev_.tree_mask, mask_at, 2);
    EXPECT_EQ(Call(splits), 1) << "a mask byte of 2 in the last request";
    Poke<uint8_t>(dev_.tree_mask, mask_at, m);

    ASSERT_EQ(dev_.Poison(), cudaSuccess);
    EXPECT_EQ(Call(splits), 0) << "the good call again";
    ExpectMatchesOracle();
  }
}

// A call whose serve byte is 0 computes nothing (o keeps its poison) and is failed.
TEST_F(CustomKernelChecksGpu, ACallNotServingWritesNothing) {
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    ASSERT_EQ(dev_.Poison(), cudaSuccess);
    ASSERT_EQ(serve_.Fill(0), cudaSuccess);
    EXPECT_EQ(Call(splits), 1);
    std::vector<uint8_t> o(bundle_->view().o_elems() * 2);
    ASSERT_EQ(cudaMemcpy(o.data(), dev_.o.get<void>(), o.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::count(o.begin(), o.end(), uint8_t{0xFF}), static_cast<long>(o.size()))
        << "o written by a call that was not to run";
    ASSERT_EQ(serve_.Fill(1), cudaSuccess);
    EXPECT_EQ(Call(splits), 0);
  }
}

// A NaN in a query: its row sees no key (lse -inf), which the store's check fails.
TEST_F(CustomKernelChecksGpu, ANaNInAQueryFailsTheCall) {
  for (int splits : {1, 3}) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    const uint16_t q = Peek<uint16_t>(dev_.q, 5 * kernels::kHeadDimQK + 7);
    Poke<uint16_t>(dev_.q, 5 * kernels::kHeadDimQK + 7, uint16_t{0x7FC0});
    EXPECT_EQ(Call(splits), 1);
    Poke<uint16_t>(dev_.q, 5 * kernels::kHeadDimQK + 7, q);
    EXPECT_EQ(Call(splits), 0);
  }
}

}  // namespace
}  // namespace verifyd
