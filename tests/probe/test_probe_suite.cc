// The probe suite: each probe's chosen keys really decide its rows, the suite covers the
// features it names, the clean CPU engine passes it, and a wrong custom path fails it; a fault
// the reference and custom paths share on an e4m3 pool fails the e4m3 probe against the oracle.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/bf16.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_engine.h"
#include "src/probe/probe_runner.h"
#include "src/probe/probe_suite.h"
#include "tests/common/e4m3_codes.h"

namespace verifyd {
namespace {

ProbeSuiteOptions Small() {
  ProbeSuiteOptions o;
  o.max_prefix = 1024;
  return o;
}

const ProbeBundle* Find(const std::vector<ProbeBundle>& suite, const std::string& name) {
  for (const ProbeBundle& p : suite) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

TEST(ProbeSuite, NamesEveryFeature) {
  const auto suite = BuildProbeSuite(Small());
  std::set<std::string> names;
  for (const ProbeBundle& p : suite) {
    EXPECT_TRUE(names.insert(p.name).second) << "duplicate " << p.name;
    EXPECT_FALSE(p.feature.empty()) << p.name;
  }
  for (const char* n :
       {"draft_positions/chain", "draft_positions/tree", "page_edges/page1", "page_edges/page64",
        "split_boundaries", "fully_masked_rows", "sink_recency/chain", "sink_recency/tree",
        "prefix/0", "prefix/1", "prefix/63", "prefix/65", "prefix/1023", "prefix/1024",
        "sm_scale/deepseek_v3", "kv_e4m3/scale_12.5"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_FALSE(names.count("prefix/1025"));  // bounded by max_prefix
}

// The output of every row of a dominant-key probe is its chosen key's V: the reference's output
// row equals some key's first 512 dims to bf16 precision, and the suite's rows hit the keys it
// says (every page's first and last token).
TEST(ProbeSuite, ChosenKeysDecideTheRows) {
  const auto suite = BuildProbeSuite(Small());
  const ProbeBundle* p = Find(suite, "page_edges/page64");
  ASSERT_NE(p, nullptr);
  const BundleView& v = p->bundle->view();
  auto engine = MakeCpuEngine(2);
  auto b = engine->Prepare(v, false);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(engine->Run(Path::kReference, **b).ok());
  PathOutput ref;
  ASSERT_TRUE(engine->Fetch(Path::kReference, **b, &ref).ok());
  const int64_t prefix = v.kv_lens[0] - v.shape.draft;
  std::set<int64_t> hit;
  for (int64_t row = 0; row < v.rows() * v.shape.heads; ++row) {
    const uint16_t* o = ref.o.data() + row * kernels::kHeadDimV;
    int64_t match = -1;
    for (int64_t t = 0; t < prefix && match < 0; ++t) {
      const uint16_t* k = v.KvRow(0, t);
      double err = 0, norm = 0;
      for (int d = 0; d < kernels::kHeadDimV; ++d) {
        const double diff = Bf16ToFloat(o[d]) - Bf16ToFloat(k[d]);
        err += diff * diff;
        norm += double{Bf16ToFloat(k[d])} * Bf16ToFloat(k[d]);
      }
      if (std::sqrt(err / norm) < 1e-2) match = t;
    }
    ASSERT_GE(match, 0) << "row " << row << " is no single key's V";
    hit.insert(match);
  }
  for (int64_t first = 0; first < prefix; first += 64) {
    EXPECT_TRUE(hit.count(first)) << "page start " << first;
    EXPECT_TRUE(hit.count(std::min(prefix, first + 64) - 1)) << "page end " << first;
  }
}

// The reference's output of `v`, computed at `sm_scale`.
std::vector<uint16_t> ReferenceAt(const BundleView& v, float sm_scale) {
  BundleView w = v;
  w.sm_scale = sm_scale;
  auto engine = MakeCpuEngine(2);
  auto b = engine->Prepare(w, false);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return {};
  EXPECT_TRUE(engine->Run(Path::kReference, **b).ok());
  PathOutput out;
  EXPECT_TRUE(engine->Fetch(Path::kReference, **b, &out).ok());
  return out.o;
}

// A path that ignored the bundle's scale and used 1/sqrt(192) would pass every probe at that
// scale. The suite has one at DeepSeek-V3's real scale, where such a path is far off.
TEST(ProbeSuite, AProbeAtTheRealScaleCatchesAPathThatIgnoresTheScale) {
  const auto suite = BuildProbeSuite(Small());
  int at_real_scale = 0;
  for (const ProbeBundle& p : suite) {
    const BundleView& v = p.bundle->view();
    if (v.sm_scale == kPlainSmScale) continue;
    EXPECT_EQ(v.sm_scale, kDeepSeekV3SmScale) << p.name;
    EXPECT_NEAR(v.sm_scale, 0.1352, 1e-4) << p.name;
    ++at_real_scale;
    const std::vector<uint16_t> right = ReferenceAt(v, v.sm_scale);
    const std::vector<uint16_t> wrong = ReferenceAt(v, kPlainSmScale);
    ASSERT_EQ(right.size(), wrong.size());
    const DiffStats d = CompareBf16(wrong.data(), right.data(), static_cast<int64_t>(right.size()),
                                    nullptr, nullptr, 0, Tolerance{});
    EXPECT_GT(d.rel_l2, 0.05) << p.name << ": the scale barely matters in this probe";
    EXPECT_GT(d.rel_l2, Tolerance{}.max_rel_l2) << p.name;
  }
  EXPECT_GE(at_real_scale, 1) << "no probe runs at DeepSeek-V3's softmax scale";
}

// The e4m3 probe: a pool at a scale that is neither 1 nor a power of two, with subnormal codes
// among the values its requests read and NaN in the slots they do not, held to the oracle. The
// only probe that is: the others' pools are bf16, and the oracle would double their cost.
TEST(ProbeSuite, TheE4m3ProbeReadsSubnormalsAtAScaleThatIsNotAPowerOfTwo) {
  const auto suite = BuildProbeSuite(Small());
  int e4m3 = 0;
  for (const ProbeBundle& p : suite) {
    const BundleView& v = p.bundle->view();
    EXPECT_EQ(p.against_oracle, v.shape.kv_dtype == kernels::KvDtype::kE4m3) << p.name;
    if (v.shape.kv_dtype != kernels::KvDtype::kE4m3) continue;
    ++e4m3;
    EXPECT_EQ(p.name, "kv_e4m3/scale_12.5");
    EXPECT_EQ(v.kv_scale, kE4m3ProbeKvScale);
    int exponent = 0;
    EXPECT_NE(std::frexp(v.kv_scale, &exponent), 0.5f) << "a power of two";
    EXPECT_EQ(p.bundle->spec().traffic, Traffic::kRealistic);
    EXPECT_GE(v.shape.batch, 2);
    const E4m3Codes c = CountE4m3Codes(v);
    EXPECT_EQ(c.nan, 0) << "NaN in a token the requests read";
    EXPECT_GT(c.subnormal, c.codes / 10) << c.subnormal << " subnormal codes of " << c.codes;
    EXPECT_LT(c.zero, c.subnormal);
    // The last page of each request has slots past its tokens: NaN, which a path that reads past
    // kv_len carries into its output.
    EXPECT_NE(v.kv_lens[0] % v.shape.page_size, 0);
  }
  EXPECT_EQ(e4m3, 1);
}

TEST(ProbeSuite, SplitBoundariesCoverBothSidesOfEvery64TokenBoundary) {
  const auto suite = BuildProbeSuite(Small());
  const ProbeBundle* p = Find(suite, "split_boundaries");
  ASSERT_NE(p, nullptr);
  const BundleView& v = p->bundle->view();
  EXPECT_EQ(v.kv_lens[0] - v.shape.draft, 1024);
  // 2 * 15 boundaries + the last split's 64: every one gets a row.
  EXPECT_GE(int64_t{v.shape.draft} * v.shape.heads, 2 * 15 + 64);
}

TEST(ProbeSuite, TheFullyMaskedRowSeesNothing) {
  const auto suite = BuildProbeSuite(Small());
  const ProbeBundle* p = Find(suite, "fully_masked_rows");
  ASSERT_NE(p, nullptr);
  const BundleView& v = p->bundle->view();
  const int row = v.shape.draft / 2;
  EXPECT_EQ(v.kv_lens[0], v.shape.draft);  // request 0 has no prefix
  for (int j = 0; j < v.shape.draft; ++j) EXPECT_FALSE(v.MaskBit(0, row, j));
}

TEST(ProbeSuite, ValidateNamesTheFlag) {
  ProbeSuiteOptions o;
  o.max_prefix = 10;
  EXPECT_NE(ValidateProbeSuiteOptions(o).message().find("probe_max_prefix"), std::string::npos);
  o.max_prefix = kernels::kMaxPrefix + 1;
  EXPECT_FALSE(ValidateProbeSuiteOptions(o).ok());
  o.max_prefix = kernels::kMaxPrefix;
  EXPECT_TRUE(ValidateProbeSuiteOptions(o).ok());
  EXPECT_EQ(DefaultProbeMaxPrefix("cuda"), kernels::kMaxPrefix);
  EXPECT_EQ(DefaultProbeMaxPrefix("cpu"), 2048);
}

TEST(ProbeRunner, TheCleanCpuEnginePassesEveryProbe) {
  auto engine = MakeCpuEngine(2);
  const ProbeReport r = RunProbeSuite(*engine, BuildProbeSuite(Small()), Tolerance{});
  EXPECT_TRUE(r.passed()) << r.Summary();
  EXPECT_EQ(r.failures, 0);
  EXPECT_NE(r.Summary().find("probes passed"), std::string::npos);
}

TEST(ProbeRunner, AWrongCustomPathFailsAndSaysWhich) {
  auto engine = MakeCpuEngine(2);
  engine->InjectCustomFault({CustomFault::Kind::kPerturb, 0.05});
  const ProbeReport r = RunProbeSuite(*engine, BuildProbeSuite(Small()), Tolerance{});
  EXPECT_FALSE(r.passed());
  EXPECT_GT(r.failures, 0);
  for (const ProbeResult& p : r.results) {
    if (!p.passed) {
      EXPECT_FALSE(p.reason.empty());
      EXPECT_NE(p.prepared, nullptr);  // kept for a capture
    }
  }
  EXPECT_NE(r.Summary().find("probes failed"), std::string::npos) << r.Summary();
}

// The CPU engine with a fault its reference and custom paths share on an e4m3 pool, as a fault
// in the dequantised pool both read would be (DequantizedBundle): both paths read the bundle
// with its subnormal codes flushed to zero, or at kv_scale 1, while the oracle reads it as sent.
// A bundle with a bf16 pool is left alone.
class SharedE4m3FaultEngine : public Engine {
 public:
  enum class Fault { kSubnormalsFlushed, kScaleIgnored };
  explicit SharedE4m3FaultEngine(Fault fault) : inner_(MakeCpuEngine(2)), fault_(fault) {}

  EngineInfo Info() const override { return inner_->Info(); }
  absl::StatusOr<std::shared_ptr<PreparedBundle>> Prepare(const BundleView& v,
                                                          bool detach) override {
    (void)detach;  // both sides are detached copies
    auto right = inner_->Prepare(v, true);
    if (!right.ok()) return right.status();
    auto pb = std::make_shared<Sides>(v.shape);
    pb->right = pb->wrong = *right;
    if (v.shape.kv_dtype != kernels::KvDtype::kE4m3) return pb;
    const auto* bytes = static_cast<const uint8_t*>(v.kv_pool);
    std::vector<uint8_t> pool(bytes, bytes + v.kv_bytes());
    BundleView w = v;
    if (fault_ == Fault::kSubnormalsFlushed) {
      for (uint8_t& x : pool) {
        if ((x & 0x78) == 0) x = 0;
      }
    } else {
      w.kv_scale = 1.f;
    }
    w.kv_pool = pool.data();
    auto wrong = inner_->Prepare(w, true);
    if (!wrong.ok()) return wrong.status();
    pb->wrong = *wrong;
    return pb;
  }
  absl::Status Run(Path p, PreparedBundle& b) override { return inner_->Run(p, Side(p, b)); }
  absl::Status Fetch(Path p, PreparedBundle& b, PathOutput* out) override {
    return inner_->Fetch(p, Side(p, b), out);
  }
  absl::StatusOr<double> PathSeconds(Path p, PreparedBundle& b) override {
    return inner_->PathSeconds(p, Side(p, b));
  }
  absl::StatusOr<bool> AllFinite(Path p, PreparedBundle& b) override {
    return inner_->AllFinite(p, Side(p, b));
  }
  absl::StatusOr<DiffStats> Compare(PreparedBundle& b, Path test, Path ref,
                                    const Tolerance& tol) override {
    if (ref != Path::kOracle) return inner_->Compare(Side(test, b), test, ref, tol);
    PathOutput t, r;
    if (absl::Status st = Fetch(test, b, &t); !st.ok()) return st;
    if (absl::Status st = Fetch(ref, b, &r); !st.ok()) return st;
    return CompareBf16ToF32(t.o.data(), r.o_f32.data(), static_cast<int64_t>(t.o.size()),
                            t.lse.data(), r.lse.data(), static_cast<int64_t>(t.lse.size()), tol);
  }
  void InjectCustomFault(const CustomFault& fault) override { inner_->InjectCustomFault(fault); }

 private:
  struct Sides : PreparedBundle {
    explicit Sides(const kernels::ProblemShape& s) : PreparedBundle(s) {}
    std::shared_ptr<PreparedBundle> right, wrong;  // what the oracle reads; the other paths
  };
  static PreparedBundle& Side(Path p, PreparedBundle& b) {
    auto& s = static_cast<Sides&>(b);
    return p == Path::kOracle ? *s.right : *s.wrong;
  }

  std::unique_ptr<Engine> inner_;
  Fault fault_;
};

// Such a fault moves the reference and the custom path alike, so they agree with each other:
// only the e4m3 probe fails, against the oracle, and only because it is held to it.
TEST(ProbeRunner, AFaultBothPathsShareOnAnE4m3PoolFailsTheE4m3ProbeAgainstTheOracle) {
  for (auto fault : {SharedE4m3FaultEngine::Fault::kSubnormalsFlushed,
                     SharedE4m3FaultEngine::Fault::kScaleIgnored}) {
    SCOPED_TRACE(fault == SharedE4m3FaultEngine::Fault::kSubnormalsFlushed ? "subnormals flushed"
                                                                           : "scale ignored");
    SharedE4m3FaultEngine engine(fault);
    auto suite = BuildProbeSuite(Small());
    const ProbeReport r = RunProbeSuite(engine, suite, Tolerance{});
    ASSERT_EQ(r.failures, 1) << r.Summary();
    for (const ProbeResult& p : r.results) {
      if (p.passed) continue;
      EXPECT_EQ(p.name, "kv_e4m3/scale_12.5");
      EXPECT_EQ(p.reason.rfind("reference vs oracle: ", 0), 0u) << p.reason;
      EXPECT_TRUE(Judge(p.stats, Tolerance{}).match) << "custom and reference disagree";
      EXPECT_NE(p.prepared, nullptr);  // kept for a capture
    }
    // Judged against each other only, the two paths agree.
    std::vector<ProbeBundle> e4m3_only;
    for (ProbeBundle& p : suite) {
      if (p.against_oracle) e4m3_only.push_back(std::move(p));
    }
    ASSERT_EQ(e4m3_only.size(), 1u);
    e4m3_only[0].against_oracle = false;
    const ProbeReport blind = RunProbeSuite(engine, e4m3_only, Tolerance{});
    EXPECT_TRUE(blind.passed()) << blind.Summary();
  }
}

// The e4m3 probe's cost on the clean CPU engine: the oracle is its third path.
TEST(ProbeRunner, TheE4m3ProbePassesOnTheCleanEngine) {
  auto engine = MakeCpuEngine(2);
  std::vector<ProbeBundle> suite = BuildProbeSuite(Small());
  const ProbeReport all = RunProbeSuite(*engine, suite, Tolerance{});
  ASSERT_TRUE(all.passed()) << all.Summary();
  for (const ProbeResult& p : all.results) {
    if (p.name != "kv_e4m3/scale_12.5") continue;
    std::printf("%s: %.3f s of the suite's %.3f s; custom vs reference rel-L2 %.3g\n",
                p.name.c_str(), p.seconds, all.seconds, p.stats.rel_l2);
  }
}

TEST(ProbeRunner, ACustomPathErrorFailsEveryProbe) {
  auto engine = MakeCpuEngine(2);
  engine->InjectCustomFault({CustomFault::Kind::kError, 0});
  const auto suite = BuildProbeSuite(Small());
  const ProbeReport r = RunProbeSuite(*engine, suite, Tolerance{});
  EXPECT_EQ(r.failures, static_cast<int>(suite.size()));
  EXPECT_NE(r.results[0].reason.find("custom path: INTERNAL"), std::string::npos)
      << r.results[0].reason;
}

}  // namespace
}  // namespace verifyd
