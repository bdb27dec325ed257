// The CPU reference and custom paths against the fp64 oracle on random bundles (fixed seeds).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_custom.h"
#include "src/cpu_engine/cpu_engine.h"
#include "src/cpu_engine/cpu_oracle.h"
#include "src/cpu_engine/cpu_reference.h"
#include "src/engine/call_context.h"

namespace verifyd {
namespace {

// rel-L2 against the fp64 oracle. bf16 rounding of the output alone gives ~1.5e-3; the custom
// path adds bf16 probabilities in P·V and fp32 accumulation.
constexpr double kCustomMaxRelL2 = 1e-2;
constexpr double kReferenceMaxRelL2 = 4e-3;
constexpr double kLseMaxAbs = 1e-3;

// Small tiles and chunks so that short KV sequences cross tile and split boundaries.
constexpr CpuCustomConfig kSmallTiles{/*tile_tokens=*/16, /*min_chunk_tokens=*/32,
                                      /*max_splits=*/4};

struct Outputs {
  std::vector<double> oracle_o, oracle_lse;
  std::vector<uint16_t> ref_o, custom_o;
  std::vector<float> ref_lse, custom_lse;
};

Outputs RunAll(const BundleView& v, const CpuCustomConfig& c) {
  Outputs out;
  RunOracle(v, &out.oracle_o, &out.oracle_lse);
  RunReference(v, &out.ref_o, &out.ref_lse);
  RunCustom(v, c, &out.custom_o, &out.custom_lse);
  return out;
}

DiffStats VsOracle(const std::vector<uint16_t>& o, const std::vector<float>& lse,
                   const Outputs& out) {
  std::vector<float> ref(out.oracle_o.begin(), out.oracle_o.end());
  std::vector<float> ref_lse(out.oracle_lse.begin(), out.oracle_lse.end());
  return CompareBf16ToF32(o.data(), ref.data(), static_cast<int64_t>(o.size()), lse.data(),
                          ref_lse.data(), static_cast<int64_t>(lse.size()), Tolerance{});
}

// Worst rel-L2 seen by ExpectCloseToOracle, printed at the end of the sweep.
struct Worst {
  double reference = 0, custom = 0, custom_vs_reference = 0;
};

void ExpectCloseToOracle(const RandomBundleSpec& spec, const CpuCustomConfig& c,
                         Worst* worst = nullptr) {
  SCOPED_TRACE(::testing::Message() << "seed " << spec.seed << " T " << spec.draft << " prefix "
                                    << spec.prefix << " page " << spec.page_size);
  RandomBundle rb(spec);
  const Outputs out = RunAll(rb.view(), c);
  const DiffStats ref = VsOracle(out.ref_o, out.ref_lse, out);
  const DiffStats cus = VsOracle(out.custom_o, out.custom_lse, out);
  // NaN/Inf first: a read of a poisoned pool slot shows up here.
  EXPECT_EQ(ref.nan_test + ref.inf_test, 0);
  EXPECT_EQ(cus.nan_test + cus.inf_test, 0);
  EXPECT_EQ(ref.nan_ref + ref.inf_ref, 0);
  EXPECT_LT(ref.rel_l2, kReferenceMaxRelL2);
  EXPECT_LT(cus.rel_l2, kCustomMaxRelL2);
  EXPECT_LE(ref.lse_max_abs, kLseMaxAbs);
  EXPECT_LE(cus.lse_max_abs, kLseMaxAbs);
  const DiffStats pair =
      CompareBf16(out.custom_o.data(), out.ref_o.data(), static_cast<int64_t>(out.ref_o.size()),
                  nullptr, nullptr, 0, Tolerance{});
  EXPECT_EQ(pair.nan_test + pair.nan_ref, 0);
  EXPECT_LT(pair.rel_l2, kCustomMaxRelL2);
  if (worst != nullptr) {
    worst->reference = std::max(worst->reference, ref.rel_l2);
    worst->custom = std::max(worst->custom, cus.rel_l2);
    worst->custom_vs_reference = std::max(worst->custom_vs_reference, pair.rel_l2);
  }
}

TEST(CpuPaths, OddSizesAgainstOracle) {
  uint64_t seed = 100;
  Worst worst;
  for (int draft : {1, 3, 17}) {
    for (int64_t kv_len : {1, 54, 97}) {
      if (kv_len < draft) continue;
      for (int page : {1, 16, 64}) {
        for (TreeKind tree : {TreeKind::kChain, TreeKind::kRandomTree}) {
          RandomBundleSpec s;
          s.batch = 2;
          s.draft = draft;
          s.heads = 3;
          s.page_size = page;
          s.prefix = kv_len - draft;
          s.tree = tree;
          s.seed = ++seed;
          ExpectCloseToOracle(s, kSmallTiles, &worst);
        }
      }
    }
  }
  std::printf(
      "seeds 101..%llu: worst rel_l2 vs oracle: reference %.3g, custom %.3g; "
      "custom vs reference %.3g\n",
      static_cast<unsigned long long>(seed), worst.reference, worst.custom,
      worst.custom_vs_reference);
}

// Random bundles at DeepSeek-V3's real softmax scale (YaRN included), not 1/sqrt(192).
TEST(CpuPaths, TheRealScaleAgainstOracle) {
  uint64_t seed = 300;
  for (Traffic traffic : {Traffic::kRandom, Traffic::kRealistic}) {
    for (int page : {1, 64}) {
      RandomBundleSpec s;
      s.batch = 2;
      s.draft = 5;
      s.heads = 3;
      s.page_size = page;
      s.prefix = 130;
      s.traffic = traffic;
      s.sm_scale = kDeepSeekV3SmScale;
      s.seed = ++seed;
      ExpectCloseToOracle(s, kSmallTiles);
    }
  }
}

TEST(CpuPaths, DefaultTilesAndPerRequestPrefixes) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 17;
  s.heads = 4;
  s.page_size = 16;
  s.prefix_lens = {0, 300, 97};
  s.seed = 7;
  ExpectCloseToOracle(s, CpuCustomConfig{});
}

TEST(CpuPaths, LargeLogits) {
  RandomBundleSpec s;
  s.batch = 2;
  s.draft = 8;
  s.heads = 4;
  s.page_size = 32;
  s.prefix = 129;
  s.q_scale = 8.f;
  s.seed = 16;
  ExpectCloseToOracle(s, kSmallTiles);
}

TEST(CpuPaths, FullyMaskedRowIsZeroWithNegInfLse) {
  RandomBundleSpec s;
  s.batch = 2;
  s.draft = 17;
  s.heads = 3;
  s.page_size = 16;
  s.prefix = 40;
  s.empty_row = true;  // request 0: prefix 0, row T/2 sees nothing
  s.seed = 21;
  RandomBundle rb(s);
  const BundleView& v = rb.view();
  const Outputs out = RunAll(v, kSmallTiles);
  const int empty = s.draft / 2;
  for (int h = 0; h < s.heads; ++h) {
    const int64_t row = int64_t{empty} * s.heads + h;
    EXPECT_EQ(out.oracle_lse[row], -INFINITY);
    EXPECT_EQ(out.ref_lse[row], -INFINITY);
    EXPECT_EQ(out.custom_lse[row], -INFINITY);
    for (int d = 0; d < kernels::kHeadDimV; ++d) {
      const int64_t k = row * kernels::kHeadDimV + d;
      ASSERT_EQ(out.oracle_o[k], 0.0);
      ASSERT_EQ(out.ref_o[k], 0) << "reference o[" << k << "]";
      ASSERT_EQ(out.custom_o[k], 0) << "custom o[" << k << "]";
    }
  }
  const DiffStats cus = VsOracle(out.custom_o, out.custom_lse, out);
  EXPECT_EQ(cus.nan_test + cus.inf_test, 0);
  EXPECT_LT(cus.rel_l2, kCustomMaxRelL2);
  EXPECT_EQ(cus.lse_max_abs, cus.lse_max_abs);  // compared, not NaN
  EXPECT_LE(cus.lse_max_abs, kLseMaxAbs);
}

TEST(CpuPaths, BitPackedMaskMatchesBytes) {
  for (uint64_t seed : {31, 32}) {
    RandomBundleSpec s;
    s.batch = 2;
    s.draft = 17;
    s.heads = 2;
    s.page_size = 16;
    s.prefix = 20;
    s.seed = seed;
    RandomBundle bytes(s);
    s.mask_format = kernels::MaskFormat::kBits;
    RandomBundle bits(s);
    const Outputs a = RunAll(bytes.view(), kSmallTiles);
    const Outputs b = RunAll(bits.view(), kSmallTiles);
    EXPECT_EQ(a.oracle_o, b.oracle_o);
    EXPECT_EQ(a.ref_o, b.ref_o);
    EXPECT_EQ(a.custom_o, b.custom_o);
    EXPECT_EQ(a.custom_lse, b.custom_lse);
  }
}

TEST(CpuPaths, SplitsDoNotChangeTheAnswerMuch) {
  RandomBundleSpec s;
  s.batch = 1;
  s.draft = 3;
  s.heads = 2;
  s.page_size = 64;
  s.prefix = 500;
  s.seed = 41;
  RandomBundle rb(s);
  std::vector<uint16_t> one, many;
  std::vector<float> lse_one, lse_many;
  RunCustom(rb.view(), CpuCustomConfig{64, 1 << 20, 1}, &one, &lse_one);
  RunCustom(rb.view(), CpuCustomConfig{16, 16, 64}, &many, &lse_many);
  const DiffStats d =
      CompareBf16(many.data(), one.data(), static_cast<int64_t>(one.size()), lse_many.data(),
                  lse_one.data(), static_cast<int64_t>(lse_one.size()), Tolerance{});
  EXPECT_EQ(d.nan_test + d.nan_ref, 0);
  EXPECT_LT(d.rel_l2, kCustomMaxRelL2);
  EXPECT_LT(d.lse_max_abs, 1e-4);
}

TEST(CpuEngine, RunsFetchesAndCompares) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 5;
  s.heads = 5;
  s.page_size = 16;
  s.prefix = 70;
  s.seed = 51;
  RandomBundle rb(s);
  auto engine = MakeCpuEngine(2, kSmallTiles);
  EXPECT_EQ(engine->Info().engine, "cpu");
  EXPECT_EQ(engine->Info().device, "cpu (2 threads)");
  auto pb = engine->Prepare(rb.view(), /*detach=*/true);
  ASSERT_TRUE(pb.ok()) << pb.status();
  PathOutput fetched;
  EXPECT_EQ(engine->Fetch(Path::kCustom, **pb, &fetched).code(),
            absl::StatusCode::kFailedPrecondition);
  for (Path p : {Path::kOracle, Path::kReference, Path::kCustom}) {
    ASSERT_TRUE(engine->Run(p, **pb).ok()) << PathName(p);
  }
  // The engine's parallel run equals the serial one.
  std::vector<uint16_t> o;
  std::vector<float> lse;
  RunCustom(rb.view(), kSmallTiles, &o, &lse);
  ASSERT_TRUE(engine->Fetch(Path::kCustom, **pb, &fetched).ok());
  EXPECT_EQ(fetched.o, o);
  EXPECT_EQ(fetched.lse, lse);
  EXPECT_GT(fetched.seconds, 0);
  ASSERT_TRUE(engine->Fetch(Path::kOracle, **pb, &fetched).ok());
  EXPECT_EQ(fetched.o_f32.size(), static_cast<size_t>(rb.view().o_elems()));

  auto d = engine->Compare(**pb, Path::kCustom, Path::kOracle, Tolerance{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_LT(d->rel_l2, kCustomMaxRelL2);
  EXPECT_TRUE(Judge(*d, Tolerance{}).match) << Judge(*d, Tolerance{}).reason;
  d = engine->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_LT(d->rel_l2, kCustomMaxRelL2);
  EXPECT_FALSE(engine->Compare(**pb, Path::kOracle, Path::kCustom, Tolerance{}).ok());
}

// Inline bytes parsed in place (gRPC's receive buffers, call channels) can put q and the pool at
// odd addresses: every path and the bundle's own copy give what they give on aligned memory.
TEST(CpuEngine, InputsAtOddAddressesGiveTheAlignedOutputs) {
  RandomBundleSpec s;
  s.batch = 2;
  s.draft = 3;
  s.heads = 4;
  s.page_size = 16;
  s.prefix = 45;
  s.seed = 53;
  RandomBundle rb(s);
  const BundleView& v = rb.view();
  const size_t q_bytes = size_t(v.q_elems()) * 2, kv_bytes = size_t(v.kv_elems()) * 2;
  std::vector<char> q(q_bytes + 1), kv(kv_bytes + 1);
  std::memcpy(q.data() + 1, v.q, q_bytes);
  std::memcpy(kv.data() + 1, v.kv_pool, kv_bytes);
  BundleView odd = v;
  odd.q = reinterpret_cast<const uint16_t*>(q.data() + 1);
  odd.kv_pool = reinterpret_cast<const uint16_t*>(kv.data() + 1);
  auto engine = MakeCpuEngine(2, kSmallTiles);
  for (bool detach : {false, true}) {
    auto want = engine->Prepare(v, false);
    auto got = engine->Prepare(odd, detach);
    ASSERT_TRUE(want.ok() && got.ok());
    for (Path p : {Path::kReference, Path::kCustom, Path::kOracle}) {
      ASSERT_TRUE(engine->Run(p, **want).ok());
      ASSERT_TRUE(engine->Run(p, **got).ok());
      PathOutput a, b;
      ASSERT_TRUE(engine->Fetch(p, **want, &a).ok());
      ASSERT_TRUE(engine->Fetch(p, **got, &b).ok());
      EXPECT_EQ(a.o, b.o) << PathName(p);
      EXPECT_EQ(a.o_f32, b.o_f32) << PathName(p);
      EXPECT_EQ(a.lse, b.lse) << PathName(p);
    }
    auto inputs = engine->FetchInputs(**got);
    ASSERT_TRUE(inputs.ok());
    EXPECT_EQ(std::memcmp((*inputs)->view().q, v.q, q_bytes), 0);
    EXPECT_EQ(std::memcmp((*inputs)->view().kv_pool, v.kv_pool, kv_bytes), 0);
  }
}

// A call abandoned in the middle of a path stops within a fraction of a second, not at the end of
// a head block or a KV tile: a call past its 2 s deadline once kept the daemon busy for 13 s more
// (B=4, 128K prefix). On the engine's one thread, one draft token of the reference or the oracle
// (128 heads x 64K keys in fp64) takes seconds here, and so does one KV tile of the custom path:
// 16K keys per tile stand in for the T x heads rows (up to 128K) one tile can carry.
TEST(CpuEngine, AnAbandonedCallStopsWithinASecond) {
  using Clock = CallContext::Clock;
  using Seconds = std::chrono::duration<double>;
  constexpr auto kStopWithin = std::chrono::seconds(1);  // loose: a loaded 2-core machine
  RandomBundleSpec s;
  s.batch = 4;
  s.draft = 4;
  s.heads = 128;
  s.page_size = 128;
  s.prefix = 8 * 128 - s.draft;  // 8 whole pages per request: none of their slots is poisoned
  s.seed = 81;
  RandomBundle rb(s);
  // A long sequence without generating one: each request's 8 pages, repeated.
  constexpr int kPages = 512;  // 64K tokens
  BundleView v = rb.view();
  std::vector<int32_t> indptr(s.batch + 1), indices, lens(s.batch, kPages * s.page_size);
  for (int b = 0; b < s.batch; ++b) {
    for (int j = 0; j < kPages; ++j) indices.push_back(rb.kv_indices[b * 8 + j % 8]);
    indptr[b + 1] = static_cast<int32_t>(indices.size());
  }
  v.kv_indptr = indptr.data();
  v.kv_indices = indices.data();
  v.kv_lens = lens.data();
  v.shape.num_indices = static_cast<int64_t>(indices.size());
  ASSERT_TRUE(ValidateBundle(v).ok());

  auto engine = MakeCpuEngine(1, CpuCustomConfig{/*tile_tokens=*/16 * 1024,
                                                 /*min_chunk_tokens=*/256, /*max_splits=*/1});
  auto pb = engine->Prepare(v, /*detach=*/false);
  ASSERT_TRUE(pb.ok()) << pb.status();

  // Runs `path` for a call abandoned `after` from now, by its deadline or by the client's
  // cancellation (the deadline then far away).
  auto run_abandoned = [&](Path path, bool cancel, std::chrono::milliseconds after) {
    SCOPED_TRACE(::testing::Message() << PathName(path) << (cancel ? " cancelled" : " deadline"));
    std::atomic<bool> cancelled{false};
    const Clock::time_point abandon = Clock::now() + after;
    CallContext call([&] { return cancelled.load(); },
                     cancel ? abandon + std::chrono::minutes(10) : abandon);
    std::thread client;
    if (cancel) {
      client = std::thread([&] {
        std::this_thread::sleep_until(abandon);
        cancelled = true;
      });
    }
    const absl::Status st = engine->RunForCall(path, **pb, call);
    const Clock::time_point stopped = Clock::now();
    if (client.joinable()) client.join();
    EXPECT_EQ(st.code(),
              cancel ? absl::StatusCode::kCancelled : absl::StatusCode::kDeadlineExceeded)
        << st;
    EXPECT_LT(stopped - abandon, kStopWithin);
    PathOutput out;
    EXPECT_EQ(engine->Fetch(path, **pb, &out).code(), absl::StatusCode::kFailedPrecondition)
        << "an abandoned path stores nothing";
    std::printf("%s, %s after %lld ms: %s %.3f s later\n", PathName(path),
                cancel ? "cancelled" : "deadline", static_cast<long long>(after.count()),
                absl::StatusCodeToString(st.code()).c_str(), Seconds(stopped - abandon).count());
  };
  for (Path p : {Path::kReference, Path::kCustom, Path::kOracle}) {
    run_abandoned(p, /*cancel=*/false, std::chrono::milliseconds(500));
  }
  run_abandoned(Path::kReference, /*cancel=*/true, std::chrono::milliseconds(300));
}

TEST(CpuEngine, ConcurrentRequestsGiveTheSerialAnswer) {
  auto engine = MakeCpuEngine(2, kSmallTiles);
  constexpr int kRequests = 4;
  std::vector<std::unique_ptr<RandomBundle>> bundles;
  for (int k = 0; k < kRequests; ++k) {
    RandomBundleSpec s;
    s.batch = 1 + k % 2;
    s.draft = 3 + 2 * k;
    s.heads = 3;
    s.page_size = 16;
    s.prefix = 40 + 13 * k;
    s.seed = 70 + k;
    bundles.push_back(std::make_unique<RandomBundle>(s));
  }
  std::vector<PathOutput> custom(kRequests), reference(kRequests);
  std::vector<std::thread> threads;
  for (int k = 0; k < kRequests; ++k) {
    threads.emplace_back([&, k] {
      auto pb = engine->Prepare(bundles[k]->view(), /*detach=*/true);
      ASSERT_TRUE(pb.ok());
      // Two paths of the same bundle at once, as shadow mode runs them.
      std::thread side([&] { ASSERT_TRUE(engine->Run(Path::kCustom, **pb).ok()); });
      ASSERT_TRUE(engine->Run(Path::kReference, **pb).ok());
      side.join();
      ASSERT_TRUE(engine->Fetch(Path::kCustom, **pb, &custom[k]).ok());
      ASSERT_TRUE(engine->Fetch(Path::kReference, **pb, &reference[k]).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < kRequests; ++k) {
    std::vector<uint16_t> o;
    std::vector<float> lse;
    RunCustom(bundles[k]->view(), kSmallTiles, &o, &lse);
    EXPECT_EQ(custom[k].o, o) << "request " << k;
    RunReference(bundles[k]->view(), &o, &lse);
    EXPECT_EQ(reference[k].o, o) << "request " << k;
  }
}

TEST(CpuEngine, InjectedFaults) {
  RandomBundleSpec s;
  s.batch = 1;
  s.draft = 3;
  s.heads = 2;
  s.prefix = 10;
  s.seed = 61;
  RandomBundle rb(s);
  auto engine = MakeCpuEngine(1);
  auto pb = engine->Prepare(rb.view(), /*detach=*/false);
  ASSERT_TRUE(pb.ok());
  ASSERT_TRUE(engine->Run(Path::kReference, **pb).ok());

  engine->InjectCustomFault({CustomFault::Kind::kError, 0});
  const absl::Status st = engine->Run(Path::kCustom, **pb);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(st.message(), "injected custom-path fault");

  engine->InjectCustomFault({CustomFault::Kind::kNan, 0});
  ASSERT_TRUE(engine->Run(Path::kCustom, **pb).ok());
  auto d = engine->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->nan_test, 1);
  EXPECT_FALSE(Judge(*d, Tolerance{}).match);
  EXPECT_EQ(engine->AllFinite(Path::kCustom, **pb).value_or(true), false);
  EXPECT_EQ(engine->AllFinite(Path::kReference, **pb).value_or(false), true);
  EXPECT_EQ(engine->AllFinite(Path::kOracle, **pb).status().code(),
            absl::StatusCode::kInvalidArgument);

  engine->InjectCustomFault({CustomFault::Kind::kPerturb, 0.5});
  ASSERT_TRUE(engine->Run(Path::kCustom, **pb).ok());
  d = engine->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok());
  EXPECT_GT(d->max_abs, 0.4);
  EXPECT_FALSE(Judge(*d, Tolerance{}).match);

  engine->InjectCustomFault({});
  ASSERT_TRUE(engine->Run(Path::kCustom, **pb).ok());
  EXPECT_EQ(engine->AllFinite(Path::kCustom, **pb).value_or(false), true);
  d = engine->Compare(**pb, Path::kCustom, Path::kReference, Tolerance{});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(Judge(*d, Tolerance{}).match) << Judge(*d, Tolerance{}).reason;
}

}  // namespace
}  // namespace verifyd
