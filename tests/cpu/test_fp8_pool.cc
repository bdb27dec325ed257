// e4m3 KV pools (kernels/e4m3.h, README.md "The computation"): the format's decode and encode,
// the CPU engine's paths on e4m3 bundles against the fp64 oracle and against the same bundle in
// bf16, and the contract's checks (kv_scale, the pool's dtype and size) through the codec.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/e4m3.h"
#include "src/bundle/bundle.h"
#include "src/bundle/dequantized_bundle.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/bundle/validate.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_engine.h"
#include "tests/common/e4m3_rounding.h"

namespace verifyd {
namespace {

using kernels::E4m3ToFloat;
using kernels::FloatToE4m3;
using kernels::KvDtype;

TEST(E4m3, EveryCodeDecodesToItsValueAndBack) {
  EXPECT_EQ(E4m3ToFloat(0x00), 0.f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0.001953125f);  // the smallest subnormal, 2^-9
  EXPECT_EQ(E4m3ToFloat(0x08), 0.015625f);     // the smallest normal, 2^-6
  EXPECT_EQ(E4m3ToFloat(0x38), 1.f);
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.f);
  EXPECT_EQ(E4m3ToFloat(0xfe), -448.f);
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0xff)));
  for (int x = 0; x < 256; ++x) {
    const float f = E4m3ToFloat(static_cast<uint8_t>(x));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToE4m3(f), x == 0x80 ? 0x80 : x) << "code " << x;
    EXPECT_EQ(RoundToBf16(f), f) << "code " << x << " is not exact in bf16";
  }
}

// The custom kernel's widening (v3e): every code's bits placed as a bf16 (E4m3WidenBits) and
// multiplied by 2^120 give its value exactly, the sign of zero included; only the two NaN codes
// need their own handling. A bf16 is the upper half of an fp32, and the product is exact in
// fp32 here, so this is what the device's bf16x2 multiply computes.
TEST(E4m3, WideningByBitsGivesEveryCodesValue) {
  const float scale = Bf16ToFloat(kernels::kE4m3WidenScaleBf16);
  EXPECT_EQ(scale, std::ldexp(1.f, 120));
  for (int x = 0; x < 256; ++x) {
    const uint8_t code = static_cast<uint8_t>(x);
    const float widened = Bf16ToFloat(kernels::E4m3WidenBits(code)) * scale;
    const float want = E4m3ToFloat(code);
    if (std::isnan(want)) {
      EXPECT_EQ(widened, 480.f * (x & 0x80 ? -1.f : 1.f)) << "code " << x;
      continue;
    }
    EXPECT_EQ(widened, want) << "code " << x;
    EXPECT_EQ(std::signbit(widened), std::signbit(want)) << "code " << x;
  }
}

TEST(E4m3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(FloatToE4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: the even one
  EXPECT_EQ(FloatToE4m3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25: 1.25
  EXPECT_EQ(FloatToE4m3(1.07f), 0x39);    // past halfway
  EXPECT_EQ(FloatToE4m3(1000.f), 0x7e);   // saturates at 448, never NaN
  EXPECT_EQ(FloatToE4m3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToE4m3(NAN), 0x7f);
  EXPECT_EQ(FloatToE4m3(0.0009765625f), 0x00);  // half the smallest subnormal: to even (0)
  EXPECT_EQ(FloatToE4m3(0.0009766f), 0x01);
}

// A random bundle with its pool in e4m3 at `scale`, and the same values as a bf16 pool (exact at
// scale 1), for the bf16 paths to agree with.
struct Fp8Bundle {
  Fp8Bundle(RandomBundleSpec spec, float scale) : rb(WithE4m3(spec, scale)), e4m3(rb.kv_pool_e4m3) {
    as_bf16.resize(e4m3.size());
    for (size_t i = 0; i < e4m3.size(); ++i) {
      as_bf16[i] = FloatToBf16(E4m3ToFloat(e4m3[i]) * scale);
    }
    view = rb.view();
    bf16_view = view;
    bf16_view.kv_pool = as_bf16.data();
    bf16_view.shape.kv_dtype = KvDtype::kBf16;
    bf16_view.kv_scale = 1.f;
  }
  static RandomBundleSpec WithE4m3(RandomBundleSpec s, float scale) {
    s.kv_dtype = KvDtype::kE4m3;
    s.kv_scale = scale;
    return s;
  }
  RandomBundle rb;
  const std::vector<uint8_t>& e4m3;
  std::vector<uint16_t> as_bf16;
  BundleView view, bf16_view;
};

RandomBundleSpec Ragged(uint64_t seed, int page_size) {
  RandomBundleSpec s;
  s.batch = 3;
  s.draft = 7;
  s.heads = 5;
  s.page_size = page_size;
  s.prefix_lens = {45, 0, 131};
  s.traffic = Traffic::kRealistic;
  s.seed = seed;
  return s;
}

PathOutput RunPath(Engine& engine, const BundleView& v, Path p, bool detach = false) {
  auto pb = engine.Prepare(v, detach);
  EXPECT_TRUE(pb.ok()) << pb.status();
  EXPECT_TRUE(engine.Run(p, **pb).ok());
  PathOutput out;
  EXPECT_TRUE(engine.Fetch(p, **pb, &out).ok());
  return out;
}

// With scale 1 (SGLang's default) every e4m3 value is exact in bf16: each path's output on the
// e4m3 pool is bit for bit its output on the bf16 pool of the same values.
TEST(Fp8Pool, AtScaleOneEveryPathEqualsItsRunOnTheSameValuesInBf16) {
  auto engine = MakeCpuEngine(2, CpuCustomConfig{16, 32, 4});
  for (int page : {1, 16}) {
    Fp8Bundle b(Ragged(91 + page, page), 1.f);
    BundleView v = b.view;
    ASSERT_TRUE(ValidateBundle(v).ok());
    for (Path p : {Path::kOracle, Path::kReference, Path::kCustom}) {
      const PathOutput e = RunPath(*engine, b.view, p);
      const PathOutput f = RunPath(*engine, b.bf16_view, p);
      EXPECT_EQ(e.o, f.o) << PathName(p) << " page " << page;
      EXPECT_EQ(e.o_f32, f.o_f32) << PathName(p) << " page " << page;
      EXPECT_EQ(e.lse, f.lse) << PathName(p) << " page " << page;
    }
  }
}

// Any other scale: the oracle reads e4m3 x scale in fp32; the reference and custom paths read the
// e4m3 values in bf16 and apply the scale to the logits and to o. Both stay within the bf16
// tolerances of the oracle, their lse within fp32 rounding of it, and the oracle moves with the
// scale (a path that ignored it would be off by the factor).
TEST(Fp8Pool, AScaledPoolMatchesTheOracleWithinBf16Tolerance) {
  auto engine = MakeCpuEngine(2, CpuCustomConfig{16, 32, 4});
  for (float scale : {0.37f, 3.1f}) {
    Fp8Bundle b(Ragged(7, 16), scale);
    BundleView v = b.view;
    ASSERT_TRUE(ValidateBundle(v).ok());
    auto pb = engine->Prepare(v, /*detach=*/true);
    ASSERT_TRUE(pb.ok()) << pb.status();
    for (Path p : {Path::kOracle, Path::kReference, Path::kCustom}) {
      ASSERT_TRUE(engine->Run(p, **pb).ok()) << PathName(p);
    }
    for (Path p : {Path::kReference, Path::kCustom}) {
      auto d = engine->Compare(**pb, p, Path::kOracle, Tolerance{});
      ASSERT_TRUE(d.ok()) << d.status();
      const Verdict verdict = Judge(*d, Tolerance{});
      EXPECT_TRUE(verdict.match) << PathName(p) << " scale " << scale << ": " << verdict.reason;
      EXPECT_LT(d->rel_l2, p == Path::kReference ? 4e-3 : 1e-2)
          << PathName(p) << " scale " << scale;
      EXPECT_LT(d->lse_max_abs, 1e-4) << PathName(p) << " scale " << scale;
    }
    // The scale reaches the values: the oracle on the same bytes read at scale 1 is another
    // output.
    PathOutput scaled, unscaled;
    ASSERT_TRUE(engine->Fetch(Path::kOracle, **pb, &scaled).ok());
    BundleView at_one = v;
    at_one.kv_scale = 1.f;
    unscaled = RunPath(*engine, at_one, Path::kOracle);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < scaled.o_f32.size(); ++i) {
      diff += std::pow(scaled.o_f32[i] - unscaled.o_f32[i], 2);
      norm += std::pow(scaled.o_f32[i], 2);
    }
    EXPECT_GT(std::sqrt(diff / norm), 0.05) << "scale " << scale;
  }
}

// The scale goes onto o before its one rounding (BundleView::o_scale), in the reference and the
// custom path alike: on a bundle where every row is the scaled mean of 64 V rows, each path's o
// is the oracle's rounded to bf16 in nearly every element, where scaling the rounded o would
// miss it in many (tests/common/e4m3_rounding.h).
TEST(Fp8Pool, TheScaleGoesOnBeforeOsOneRounding) {
  auto engine = MakeCpuEngine(2, CpuCustomConfig{16, 32, 4});
  for (float scale : {0.37f, 3.1f}) {
    for (int page : {1, 16}) {
      RandomBundle rb(EqualWeightsE4m3Spec(scale, page, 17 + page));
      const PathOutput oracle = RunPath(*engine, rb.view(), Path::kOracle);
      const double twice = ShareIfRoundedTwice(oracle.o_f32, scale);
      EXPECT_LT(twice, 0.9) << "the bundle does not tell one rounding from two";
      for (Path p : {Path::kReference, Path::kCustom}) {
        const double once = ShareRoundedOnce(RunPath(*engine, rb.view(), p).o, oracle.o_f32);
        std::printf("[ metrics  ] %s scale %g page %d: %.4f of o rounded once (%.4f if twice)\n",
                    PathName(p), scale, page, once, twice);
        EXPECT_GT(once, 0.97) << PathName(p) << " scale " << scale << " page " << page;
      }
    }
  }
}

// A copy for work after the response keeps the e4m3 bytes (a shared pool's named pages only).
TEST(Fp8Pool, AnOwnedCopyKeepsTheE4m3BytesOfTheNamedPages) {
  Fp8Bundle b(Ragged(3, 16), 0.5f);
  BundleView shared = b.view;
  shared.kv_pool_shared = true;
  ASSERT_TRUE(ValidateBundle(shared).ok());
  OwnedBundle owned(shared);
  const BundleView& o = owned.view();
  EXPECT_EQ(o.shape.kv_dtype, KvDtype::kE4m3);
  EXPECT_EQ(o.kv_scale, 0.5f);
  EXPECT_EQ(o.shape.num_pages, shared.shape.num_indices);
  EXPECT_EQ(OwnedBundle::BytesFor(shared),
            shared.q_elems() * 2 + shared.shape.num_indices * shared.page_bytes() +
                (int64_t{shared.shape.batch} * 2 + 1 + shared.shape.num_indices) * 4 +
                shared.mask_bytes());
  for (int bi = 0; bi < o.shape.batch; ++bi) {
    for (int64_t t = 0; t < o.kv_lens[bi]; ++t) {
      float want[kernels::kHeadDimQK], got[kernels::kHeadDimQK];
      shared.KvRowFloat(bi, t, kernels::kHeadDimQK, want);
      o.KvRowFloat(bi, t, kernels::kHeadDimQK, got);
      ASSERT_EQ(std::memcmp(want, got, sizeof want), 0) << "request " << bi << " token " << t;
    }
  }
}

TEST(Fp8Pool, TheCodecCarriesTheDtypeAndTheScale) {
  Fp8Bundle b(Ragged(5, 1), 0.25f);
  v1::VerifyRequest req;
  EncodeRequest(b.view, &req);
  EXPECT_EQ(req.kv_pool().dtype(), v1::DTYPE_F8E4M3);
  EXPECT_EQ(req.kv_pool().raw_contents().size(), b.e4m3.size());
  ASSERT_TRUE(req.has_kv_scale());
  EXPECT_EQ(req.kv_scale(), 0.25f);
  auto v = DecodeRequest(req);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->shape.kv_dtype, KvDtype::kE4m3);
  EXPECT_EQ(v->kv_scale, 0.25f);
  EXPECT_EQ(std::memcmp(v->kv_pool, b.e4m3.data(), b.e4m3.size()), 0);
  // A bf16 bundle sends no scale.
  v1::VerifyRequest plain;
  EncodeRequest(b.bf16_view, &plain);
  EXPECT_EQ(plain.kv_pool().dtype(), v1::DTYPE_BF16);
  EXPECT_FALSE(plain.has_kv_scale());
  // An e4m3 pool sent without a scale reads at 1.
  req.clear_kv_scale();
  v = DecodeRequest(req);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->kv_scale, 1.f);
}

void ExpectRefused(const v1::VerifyRequest& req, const std::string& starts) {
  auto v = DecodeRequest(req);
  ASSERT_FALSE(v.ok()) << "accepted; expected: " << starts;
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(v.status().message()).rfind(starts, 0), 0u) << v.status();
}

TEST(Fp8Pool, ABadScaleOrPoolIsRefusedNamingTheField) {
  Fp8Bundle b(Ragged(11, 16), 1.f);
  v1::VerifyRequest good;
  EncodeRequest(b.view, &good);
  for (float bad : {0.f, -1.f, NAN, INFINITY, -0.f}) {
    v1::VerifyRequest r = good;
    r.set_kv_scale(bad);
    ExpectRefused(r, "kv_scale: ");
  }
  v1::VerifyRequest bf16;
  EncodeRequest(b.bf16_view, &bf16);
  bf16.set_kv_scale(2.f);
  ExpectRefused(bf16, "kv_scale: 2 is for an e4m3 pool");
  bf16.set_kv_scale(1.f);
  EXPECT_TRUE(DecodeRequest(bf16).ok());
  v1::VerifyRequest f32 = good;
  f32.mutable_kv_pool()->set_dtype(v1::DTYPE_F32);
  ExpectRefused(f32, "kv_pool: dtype DTYPE_F32, expected DTYPE_BF16 or DTYPE_F8E4M3");
  // e4m3 bytes labelled bf16 are half the bytes the shape needs.
  v1::VerifyRequest mislabelled = good;
  mislabelled.mutable_kv_pool()->set_dtype(v1::DTYPE_BF16);
  ExpectRefused(mislabelled, "kv_pool: ");
}

}  // namespace
}  // namespace verifyd
