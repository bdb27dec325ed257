// The GPU reference launcher, the comparison reduction and the oracle kernel, called directly:
// chunk planning bounds (no GPU needed), chunked vs whole launches, the unaligned-pool gather,
// poisoned outputs and sentinels, and the device comparison on planted NaN/Inf against the host.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reference/compare_kernels.h"
#include "kernels/reference/finite_check_kernels.h"
#include "kernels/reference/oracle_kernel.h"
#include "kernels/reference/page_gather_kernels.h"
#include "kernels/reference/reference_attention.h"
#include "kernels/reference/reference_plan.h"
#include "src/bundle/random_bundle.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_oracle.h"
#include "src/cuda_engine/device_diff_stats.h"
#include "tests/common/gpu_test_support.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(expr)

// Device memory with `pad` bytes of sentinel after the payload (out-of-bounds writes show there).
class DeviceBytes {
 public:
  DeviceBytes(size_t bytes, size_t pad = 0) : bytes_(bytes), pad_(pad) {
    if (cudaMalloc(&ptr_, bytes + pad + 16) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBytes() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  char* get(size_t offset = 0) const { return static_cast<char*>(ptr_) + offset; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_, pad_;
};

template <typename T>
std::vector<T> Download(const void* dev, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

void Upload(void* dev, const void* host, size_t bytes) {
  EXPECT_EQ(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// A bundle's inputs on the device; kv_pool optionally 2 bytes off 16-byte alignment.
struct DeviceBundle {
  DeviceBundle(const BundleView& v, bool misalign_kv)
      : q(v.q_elems() * 2),
        kv(v.kv_elems() * 2 + 16),
        indptr((v.shape.batch + 1) * 4),
        indices(std::max<int64_t>(v.shape.num_indices, 1) * 4),
        lens(v.shape.batch * 4),
        mask(v.mask_bytes()) {
    const size_t kv_offset = misalign_kv ? 2 : 0;
    Upload(q.get(), v.q, q.bytes());
    Upload(kv.get(kv_offset), v.kv_pool, v.kv_elems() * 2);
    Upload(indptr.get(), v.kv_indptr, indptr.bytes());
    Upload(indices.get(), v.kv_indices, v.shape.num_indices * 4);
    Upload(lens.get(), v.kv_lens, lens.bytes());
    Upload(mask.get(), v.tree_mask, mask.bytes());
    p.shape = v.shape;
    p.q = reinterpret_cast<const uint16_t*>(q.get());
    p.kv_pool = reinterpret_cast<const uint16_t*>(kv.get(kv_offset));
    p.kv_indptr = reinterpret_cast<const int32_t*>(indptr.get());
    p.kv_indices = reinterpret_cast<const int32_t*>(indices.get());
    p.kv_lens = reinterpret_cast<const int32_t*>(lens.get());
    p.tree_mask = reinterpret_cast<const uint8_t*>(mask.get());
    p.sm_scale = v.sm_scale;
    p.max_kv_len = v.max_kv_len;
    p.total_kv_len = v.total_kv_len;
  }
  DeviceBytes q, kv, indptr, indices, lens, mask;
  kernels::VerifyProblem p;
};

TEST(ReferencePlan, LargestShapeStaysWithinTheBudget) {
  kernels::VerifyProblem p;
  p.shape = {256, 1024, 128, 64, 1 << 20, 1 << 20, kernels::MaskFormat::kBits};
  p.max_kv_len = kernels::kMaxPrefix + 1024;
  const kernels::ReferencePlan plan = kernels::PlanReference(p);
  EXPECT_EQ(plan.requests, 1);
  EXPECT_GE(plan.rows, 1);
  EXPECT_LT(plan.rows, plan.rows_total);
  EXPECT_GE(plan.kv_stride, p.max_kv_len);
  EXPECT_EQ(plan.kv_stride % 32, 0);
  EXPECT_LE(plan.total_bytes, kernels::kReferenceChunkBudget + kernels::kReferenceCublasWorkspace +
                                  (size_t{1} << 20));
  EXPECT_EQ(kernels::ReferenceWorkspaceBytes(p), plan.total_bytes);
}

TEST(ReferencePlan, ManySmallRequestsShareAChunk) {
  kernels::VerifyProblem p;
  p.shape = {256, 8, 16, 16, 100000, 100000, kernels::MaskFormat::kBytes};
  p.max_kv_len = 4096 + 8;
  const kernels::ReferencePlan plan = kernels::PlanReference(p);
  EXPECT_GT(plan.requests, 1);
  EXPECT_EQ(plan.rows, plan.rows_total);
  EXPECT_LE(plan.total_bytes,
            kernels::kReferenceChunkBudget + kernels::kReferenceCublasWorkspace + 4096);
  p.shape.batch = 3;
  p.max_kv_len = 1;
  const kernels::ReferencePlan tiny = kernels::PlanReference(p);
  EXPECT_EQ(tiny.requests, 3);
  EXPECT_EQ(tiny.kv_stride, 32);
  EXPECT_LT(tiny.total_bytes, kernels::kReferenceCublasWorkspace + (size_t{1} << 20));
}

// Runs the reference with `plan` into NaN-poisoned outputs followed by sentinels.
struct RefRun {
  std::vector<uint16_t> o;
  std::vector<float> lse;
  bool sentinels_intact = false;
};

constexpr size_t kSentinelBytes = 256;
constexpr unsigned char kSentinel = 0x5a;

RefRun RunReferencePlanned(const DeviceBundle& db, int64_t n_o, int64_t n_lse,
                           const kernels::ReferencePlan& plan) {
  RefRun out;
  DeviceBytes o(n_o * 2, kSentinelBytes), lse(n_lse * 4, kSentinelBytes), ws(plan.total_bytes);
  EXPECT_EQ(cudaMemset(o.get(), 0xff, n_o * 2), cudaSuccess);      // bf16 NaN
  EXPECT_EQ(cudaMemset(lse.get(), 0xff, n_lse * 4), cudaSuccess);  // fp32 NaN
  EXPECT_EQ(cudaMemset(o.get(n_o * 2), kSentinel, kSentinelBytes), cudaSuccess);
  EXPECT_EQ(cudaMemset(lse.get(n_lse * 4), kSentinel, kSentinelBytes), cudaSuccess);
  cublasHandle_t handle;
  EXPECT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  kernels::VerifyProblem p = db.p;
  p.o = reinterpret_cast<uint16_t*>(o.get());
  p.lse = reinterpret_cast<float*>(lse.get());
  EXPECT_EQ(kernels::LaunchReferencePlanned(p, plan, ws.get(), ws.bytes(), handle, stream),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  out.o = Download<uint16_t>(o.get(), n_o);
  out.lse = Download<float>(lse.get(), n_lse);
  const auto tail_o = Download<unsigned char>(o.get(n_o * 2), kSentinelBytes);
  const auto tail_lse = Download<unsigned char>(lse.get(n_lse * 4), kSentinelBytes);
  out.sentinels_intact = true;
  for (unsigned char c : tail_o) out.sentinels_intact &= c == kSentinel;
  for (unsigned char c : tail_lse) out.sentinels_intact &= c == kSentinel;
  cudaStreamDestroy(stream);
  cublasDestroy(handle);
  return out;
}

RandomBundleSpec ChunkingSpec() {
  RandomBundleSpec s;
  s.batch = 5;
  s.draft = 9;
  s.heads = 16;
  s.page_size = 16;
  s.prefix_lens = {0, 54, 97, 1, 200};
  s.mask_format = kernels::MaskFormat::kBits;
  s.empty_row = true;
  s.seed = 42;
  return s;
}

TEST(ReferenceKernel, ChunkingDoesNotChangeTheResult) {
  VERIFYD_SKIP_WITHOUT_GPU();
  RandomBundle rb(ChunkingSpec());
  const BundleView& v = rb.view();
  DeviceBundle db(v, /*misalign_kv=*/false);
  const int64_t n = v.o_elems(), n_lse = v.lse_elems();

  std::vector<double> oracle_o, oracle_lse;
  RunOracle(v, &oracle_o, &oracle_lse);
  const std::vector<float> truth(oracle_o.begin(), oracle_o.end());
  const std::vector<float> truth_lse(oracle_lse.begin(), oracle_lse.end());

  const kernels::ReferencePlan whole = kernels::PlanReference(db.p);
  ASSERT_EQ(whole.requests, 5);
  const size_t k_bytes = size_t(whole.kv_stride) * kHeadDimQK * 2;
  const size_t request_bytes = k_bytes + size_t(whole.rows_total) * whole.kv_stride * 6;
  // Two requests per chunk (three chunks), then one request cut into row chunks of 37 rows.
  const kernels::ReferencePlan two = kernels::PlanReference(db.p, 2 * request_bytes + 100);
  ASSERT_EQ(two.requests, 2);
  const kernels::ReferencePlan rows =
      kernels::PlanReference(db.p, k_bytes + 37 * size_t(whole.kv_stride) * 6);
  ASSERT_EQ(rows.requests, 1);
  ASSERT_EQ(rows.rows, 37);

  const RefRun a = RunReferencePlanned(db, n, n_lse, whole);
  for (const auto* plan : {&two, &rows}) {
    SCOPED_TRACE(::testing::Message() << "requests " << plan->requests << " rows " << plan->rows);
    const RefRun b = RunReferencePlanned(db, n, n_lse, *plan);
    EXPECT_TRUE(b.sentinels_intact);
    const DiffStats vs_oracle = CompareBf16ToF32(b.o.data(), truth.data(), n, b.lse.data(),
                                                 truth_lse.data(), n_lse, Tolerance{});
    EXPECT_EQ(vs_oracle.nan_test + vs_oracle.inf_test, 0);  // every output written
    EXPECT_LT(vs_oracle.rel_l2, testing::kReferenceMaxRelL2);
    EXPECT_LE(vs_oracle.lse_max_abs, testing::kLseMaxAbs);
    const DiffStats vs_whole =
        CompareBf16(b.o.data(), a.o.data(), n, b.lse.data(), a.lse.data(), n_lse, Tolerance{});
    EXPECT_LT(vs_whole.rel_l2, 1e-3);
    std::printf("chunked (requests %d, rows %lld) vs whole: rel_l2 %.3g (%s), vs oracle %.3g\n",
                plan->requests, static_cast<long long>(plan->rows), vs_whole.rel_l2,
                b.o == a.o ? "bit-identical" : "not bit-identical", vs_oracle.rel_l2);
  }
  EXPECT_TRUE(a.sentinels_intact);
  const DiffStats a_vs = CompareBf16ToF32(a.o.data(), truth.data(), n, a.lse.data(),
                                          truth_lse.data(), n_lse, Tolerance{});
  EXPECT_EQ(a_vs.nan_test + a_vs.inf_test, 0);
  EXPECT_LT(a_vs.rel_l2, testing::kReferenceMaxRelL2);
}

TEST(ReferenceKernel, UnalignedKvPoolGivesTheSameOutput) {
  VERIFYD_SKIP_WITHOUT_GPU();
  RandomBundleSpec s = ChunkingSpec();
  s.page_size = 1;
  s.seed = 43;
  RandomBundle rb(s);
  const BundleView& v = rb.view();
  DeviceBundle aligned(v, false), unaligned(v, true);
  ASSERT_NE(reinterpret_cast<uintptr_t>(unaligned.p.kv_pool) % 16, 0u);
  const auto plan = kernels::PlanReference(aligned.p);
  const RefRun a = RunReferencePlanned(aligned, v.o_elems(), v.lse_elems(), plan);
  const RefRun b = RunReferencePlanned(unaligned, v.o_elems(), v.lse_elems(), plan);
  EXPECT_TRUE(a.o == b.o);
  EXPECT_TRUE(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0);
}

// The snapshot's gather: the named pages in order, and a range (q) in the same launch, with odd
// page and range sizes; a range off 16-byte alignment is refused.
TEST(GatherKernel, CopiesTheNamedPagesAndARangeInOneLaunch) {
  VERIFYD_SKIP_WITHOUT_GPU();
  std::mt19937 rng(61);
  for (int64_t page_bytes : {int64_t{1152}, int64_t{16 * 1152}, int64_t{64 * 1152}}) {
    for (int64_t range_bytes : {int64_t{0}, int64_t{16}, int64_t{1152 * 37}, int64_t{1 << 20}}) {
      SCOPED_TRACE(::testing::Message() << "page " << page_bytes << " range " << range_bytes);
      const int64_t pool_pages = 29, n = 17;
      std::vector<char> pool(pool_pages * page_bytes), range(range_bytes);
      for (char& c : pool) c = static_cast<char>(rng());
      for (char& c : range) c = static_cast<char>(rng());
      std::vector<int32_t> pages(n);
      for (int32_t& p : pages) p = static_cast<int32_t>(rng() % pool_pages);
      DeviceBytes d_pool(pool.size()), d_pages(n * 4), d_out(n * page_bytes + 64),
          d_range(range_bytes + 16), d_range_out(range_bytes + 64);
      Upload(d_pool.get(), pool.data(), pool.size());
      Upload(d_pages.get(), pages.data(), n * 4);
      Upload(d_range.get(), range.data(), range_bytes);
      CUDA_OK(cudaMemset(d_out.get(), 0x5a, n * page_bytes + 64));
      CUDA_OK(cudaMemset(d_range_out.get(), 0x5a, range_bytes + 64));
      const kernels::CopyRange also{d_range.get(), d_range_out.get(), range_bytes};
      CUDA_OK(kernels::LaunchGatherPages(d_pool.get(), reinterpret_cast<int32_t*>(d_pages.get()), n,
                                         page_bytes, d_out.get(), nullptr, also));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<char> out = Download<char>(d_out.get(), n * page_bytes + 64);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::memcmp(out.data() + i * page_bytes, pool.data() + pages[i] * page_bytes,
                              page_bytes),
                  0)
            << "page " << i;
      }
      for (int64_t i = n * page_bytes; i < n * page_bytes + 64; ++i) ASSERT_EQ(out[i], 0x5a);
      const std::vector<char> r = Download<char>(d_range_out.get(), range_bytes + 64);
      EXPECT_EQ(std::memcmp(r.data(), range.data(), range_bytes), 0);
      for (int64_t i = range_bytes; i < range_bytes + 64; ++i) ASSERT_EQ(r[i], 0x5a);
    }
  }
  DeviceBytes a(64), b(64);
  EXPECT_EQ(kernels::LaunchGatherPages(a.get(), nullptr, 0, 1152, b.get(), nullptr,
                                       kernels::CopyRange{a.get(8), b.get(), 32}),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::LaunchGatherPages(a.get(), nullptr, 0, 1152, b.get(), nullptr,
                                       kernels::CopyRange{a.get(), b.get(), 24}),
            cudaErrorInvalidValue);
}

TEST(OracleKernel, MatchesTheCpuOracle) {
  VERIFYD_SKIP_WITHOUT_GPU();
  RandomBundle rb(ChunkingSpec());
  const BundleView& v = rb.view();
  DeviceBundle db(v, false);
  DeviceBytes o(v.o_elems() * 4), lse(v.lse_elems() * 4);
  CUDA_OK(cudaMemset(o.get(), 0xff, o.bytes()));
  CUDA_OK(kernels::LaunchOracle(db.p, reinterpret_cast<float*>(o.get()),
                                reinterpret_cast<float*>(lse.get()), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto go = Download<float>(o.get(), v.o_elems());
  const auto gl = Download<float>(lse.get(), v.lse_elems());
  std::vector<double> oracle_o, oracle_lse;
  RunOracle(v, &oracle_o, &oracle_lse);
  const std::vector<float> truth(oracle_o.begin(), oracle_o.end());
  const std::vector<float> truth_lse(oracle_lse.begin(), oracle_lse.end());
  int64_t bad = 0;
  for (float x : go) bad += !std::isfinite(x);
  EXPECT_EQ(bad, 0);
  EXPECT_LT(testing::RelL2(go, truth.data(), v.o_elems()), testing::kOracleMaxRelL2);
  EXPECT_LE(testing::LseMaxAbs(gl, truth_lse.data(), v.lse_elems()), testing::kOracleLseMaxAbs);
  int empty = 0;
  for (int64_t r = 0; r < v.lse_elems(); ++r) empty += truth_lse[r] == -INFINITY;
  EXPECT_GT(empty, 0);
}

// The reduction against CompareBf16 / CompareBf16ToF32 on an odd size with planted NaN, +inf and
// -inf on either side, and lse rows that see nothing on one or both sides.
TEST(CompareKernel, MatchesTheHostComparison) {
  VERIFYD_SKIP_WITHOUT_GPU();
  constexpr int64_t n = 100003, n_lse = 1001;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> ref_f(n);
  std::vector<uint16_t> test(n), ref(n);
  for (int64_t i = 0; i < n; ++i) {
    ref_f[i] = normal(rng);
    ref[i] = FloatToBf16(ref_f[i]);
    test[i] = FloatToBf16(ref_f[i] + 0.02f * normal(rng));
  }
  const uint16_t kNan = 0x7fc0, kPosInf = 0x7f80, kNegInf = 0xff80;
  test[3] = kNan;                                                // NaN in test only
  ref[10] = kNan, ref_f[10] = NAN;                               // NaN in ref only
  test[20] = kNan, ref[20] = kNan, ref_f[20] = NAN;              // both: equal
  test[30] = kPosInf;                                            // inf in test only
  test[40] = kPosInf, ref[40] = kPosInf, ref_f[40] = INFINITY;   // both +inf: equal
  test[50] = kPosInf, ref[50] = kNegInf, ref_f[50] = -INFINITY;  // opposite infinities
  test[n - 1] = FloatToBf16(1000.f);  // large finite difference at the very end
  std::vector<float> test_lse(n_lse), ref_lse(n_lse);
  for (int64_t i = 0; i < n_lse; ++i) {
    ref_lse[i] = 5.f + normal(rng);
    test_lse[i] = ref_lse[i] + 1e-4f * normal(rng);
  }
  test_lse[0] = ref_lse[0] = -INFINITY;
  test_lse[1] = -INFINITY;
  ref_lse[2] = NAN;

  DeviceBytes d_test(n * 2), d_ref(n * 2), d_ref_f(n * 4), d_tl(n_lse * 4), d_rl(n_lse * 4);
  DeviceBytes ws(kernels::CompareWorkspaceBytes()), out(sizeof(kernels::DeviceDiffStats));
  Upload(d_test.get(), test.data(), n * 2);
  Upload(d_ref.get(), ref.data(), n * 2);
  Upload(d_ref_f.get(), ref_f.data(), n * 4);
  Upload(d_tl.get(), test_lse.data(), n_lse * 4);
  Upload(d_rl.get(), ref_lse.data(), n_lse * 4);

  auto device_stats = [&](kernels::DeviceValues r, bool with_lse, int64_t count) {
    const Tolerance tol;
    EXPECT_EQ(
        kernels::LaunchCompare({d_test.get(), kernels::ElemType::kBf16}, r, count,
                               with_lse ? reinterpret_cast<float*>(d_tl.get()) : nullptr,
                               with_lse ? reinterpret_cast<float*>(d_rl.get()) : nullptr, n_lse,
                               ToCompareLimits(tol), ws.get(), ws.bytes(),
                               reinterpret_cast<kernels::DeviceDiffStats*>(out.get()), nullptr),
        cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return ToDiffStats(Download<kernels::DeviceDiffStats>(out.get(), 1)[0]);
  };

  const Tolerance tol;
  {
    SCOPED_TRACE("bf16 vs bf16 with lse");
    const DiffStats host =
        CompareBf16(test.data(), ref.data(), n, test_lse.data(), ref_lse.data(), n_lse, tol);
    const DiffStats dev = device_stats({d_ref.get(), kernels::ElemType::kBf16}, true, n);
    testing::ExpectSameStats(dev, host);
    EXPECT_EQ(host.nan_test, 2);
    EXPECT_TRUE(std::isinf(host.lse_max_abs));
  }
  {
    SCOPED_TRACE("bf16 vs fp32 without lse");
    const DiffStats host = CompareBf16ToF32(test.data(), ref_f.data(), n, nullptr, nullptr, 0, tol);
    const DiffStats dev = device_stats({d_ref_f.get(), kernels::ElemType::kF32}, false, n);
    testing::ExpectSameStats(dev, host);
    EXPECT_TRUE(std::isnan(dev.lse_max_abs));
  }
  {
    SCOPED_TRACE("finite prefix only");
    const DiffStats host = CompareBf16(test.data(), ref.data(), 3, nullptr, nullptr, 0, tol);
    const DiffStats dev = device_stats({d_ref.get(), kernels::ElemType::kBf16}, false, 3);
    testing::ExpectSameStats(dev, host);
    EXPECT_GT(dev.rel_l2, 0);
  }
  {
    SCOPED_TRACE("empty");
    const DiffStats dev = device_stats({d_ref.get(), kernels::ElemType::kBf16}, false, 0);
    EXPECT_EQ(dev.count, 0);
    EXPECT_EQ(dev.rel_l2, 0);
    EXPECT_EQ(dev.max_abs, 0);
  }
}

// The flag of LaunchFlagNonFinite for o (bf16, starting `offset` elements into the allocation so
// that the unaligned path runs too) and lse.
bool FlagNonFinite(const std::vector<uint16_t>& o, size_t offset, const std::vector<float>& lse) {
  uint16_t* d_o = nullptr;
  float* d_lse = nullptr;
  unsigned* d_flag = nullptr;
  EXPECT_EQ(cudaMalloc(&d_o, (o.size() + offset) * 2), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_lse, std::max<size_t>(lse.size(), 1) * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_flag, sizeof(unsigned)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_o + offset, o.data(), o.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_lse, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_flag, 0, sizeof(unsigned)), cudaSuccess);
  EXPECT_EQ(kernels::LaunchFlagNonFinite(d_o + offset, static_cast<int64_t>(o.size()), d_lse,
                                         static_cast<int64_t>(lse.size()), d_flag, nullptr),
            cudaSuccess);
  unsigned flag = 7;
  EXPECT_EQ(cudaMemcpy(&flag, d_flag, sizeof(unsigned), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_o);
  cudaFree(d_lse);
  cudaFree(d_flag);
  return flag != 0;
}

TEST(FiniteCheckKernel, FlagsNanAndInfAnywhereInOAndLse) {
  VERIFYD_SKIP_WITHOUT_GPU();
  const size_t n = 8 * 1000 + 5;  // a tail past the last 16-byte word
  std::vector<uint16_t> o(n);
  for (size_t i = 0; i < n; ++i) o[i] = FloatToBf16(std::sin(0.01f * i) * 3.f);
  std::vector<float> lse(321, 1.5f);
  lse[7] = -INFINITY;  // a row that sees no key: not a fault
  for (size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE(offset);
    EXPECT_FALSE(FlagNonFinite(o, offset, lse));
    for (size_t at : {size_t{0}, size_t{3}, n / 2, n - 1}) {
      for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
        std::vector<uint16_t> o_bad = o;
        o_bad[at] = bad;
        EXPECT_TRUE(FlagNonFinite(o_bad, offset, lse)) << "at " << at << " value " << bad;
      }
    }
  }
  for (float bad : {NAN, INFINITY}) {
    std::vector<float> lse_bad = lse;
    lse_bad[lse.size() - 1] = bad;
    EXPECT_TRUE(FlagNonFinite(o, 0, lse_bad)) << bad;
  }
}

}  // namespace
}  // namespace verifyd
