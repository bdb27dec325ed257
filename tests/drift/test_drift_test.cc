// The oracle drift statistic: on synthetic streams with fixed seeds, and on oracle samples of the
// real CPU engine (clean, and with its P·V accumulator in bf16).

#include <cmath>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "src/control/drift_test.h"
#include "tests/drift/drift_streams.h"

namespace verifyd {
namespace {

// Reference errors like bf16 rounding of the output (about 1e-3, varying by call), and custom's
// error `ratio` times that with lognormal spread `sd` in the log ratio.
int FirstBreach(uint64_t seed, double ratio, double sd, int samples, const DriftOptions& o = {}) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> ref(8e-4, 1.6e-3);
  std::normal_distribution<double> noise(0, sd);
  DriftTest t(o);
  for (int i = 1; i <= samples; ++i) {
    const double r = ref(rng);
    if (t.Add(r * ratio * std::exp(noise(rng)), r).breach) return i;
  }
  return -1;
}

TEST(DriftTest, CleanStreamsNeverTrip) {
  // Measured clean streams (drift_calibration) have a geometric-mean ratio of at most 1.09 and a
  // log-ratio sd of at most 0.02; these are harsher in both and still never trip.
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    EXPECT_EQ(FirstBreach(seed, 1.0, 0.15, 2000), -1) << "seed " << seed;
    EXPECT_EQ(FirstBreach(seed, 1.15, 0.2, 2000), -1) << "seed " << seed;
  }
}

TEST(DriftTest, TwiceTheReferenceErrorTripsWithinMinSamples) {
  const DriftOptions o;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    const int first = FirstBreach(seed, 2.0, 0.15, 1000);
    EXPECT_GE(first, o.min_samples) << "seed " << seed;
    EXPECT_LE(first, o.min_samples) << "seed " << seed;
  }
  // Noisier streams take a few samples more, never more than the window.
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    const int first = FirstBreach(seed, 2.0, 0.4, 1000);
    EXPECT_GE(first, o.min_samples) << "seed " << seed;
    EXPECT_LE(first, o.window) << "seed " << seed;
  }
}

TEST(DriftTest, NoVerdictBeforeMinSamples) {
  DriftOptions o;
  o.min_samples = 8;
  DriftTest t(o);
  for (int i = 1; i < 8; ++i) {
    const DriftReading r = t.Add(1e-2, 1e-3);
    EXPECT_FALSE(r.breach);
    EXPECT_TRUE(std::isnan(r.t));
    EXPECT_EQ(r.samples, i);
    EXPECT_NEAR(r.ratio, 10, 1e-2);
  }
  EXPECT_TRUE(t.Add(1e-2, 1e-3).breach);
}

TEST(DriftTest, WindowSlidesBackToCleanAfterAFix) {
  DriftTest t({});
  for (int i = 0; i < 64; ++i) t.Add(3e-3, 1e-3);
  EXPECT_TRUE(t.Reading().breach);
  for (int i = 0; i < 64; ++i) t.Add(1.1e-3, 1e-3);
  EXPECT_FALSE(t.Reading().breach);
  EXPECT_EQ(t.Reading().samples, 64);
  EXPECT_NEAR(t.Reading().ratio, 1.1, 1e-3);
}

TEST(DriftTest, NonFiniteAndNegativeSamplesAreNotAdded) {
  DriftTest t({});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  t.Add(nan, 1e-3);
  t.Add(1e-3, inf);
  t.Add(-1, 1e-3);
  EXPECT_EQ(t.Reading().samples, 0);
  EXPECT_EQ(t.Add(1e-3, 1e-3).samples, 1);
}

TEST(DriftTest, ExactSamplesGiveRatioOne) {
  // Both paths exact (a row that sees nothing): the floor keeps the ratio finite and 1.
  DriftTest t({});
  for (int i = 0; i < 20; ++i) t.Add(0, 0);
  EXPECT_DOUBLE_EQ(t.Reading().ratio, 1);
  EXPECT_FALSE(t.Reading().breach);
}

TEST(DriftTest, ValidateNamesTheFlag) {
  DriftOptions o;
  EXPECT_TRUE(ValidateDriftOptions(o).ok());
  o.window = 1;
  EXPECT_NE(ValidateDriftOptions(o).message().find("drift_window"), std::string::npos);
  o = {};
  o.min_samples = 100;
  EXPECT_NE(ValidateDriftOptions(o).message().find("drift_min_samples"), std::string::npos);
  o = {};
  o.max_ratio = 0.5;
  EXPECT_NE(ValidateDriftOptions(o).message().find("drift_max_ratio"), std::string::npos);
  o = {};
  o.min_t = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(ValidateDriftOptions(o).message().find("drift_min_t"), std::string::npos);
}

TEST(DriftTest, DescribeSaysRatioAndVerdict) {
  DriftTest t({});
  EXPECT_EQ(DescribeDrift(t.Reading(), t.options()), "no oracle samples yet");
  for (int i = 0; i < 16; ++i) t.Add(2e-3, 1e-3);
  const std::string s = DescribeDrift(t.Reading(), t.options());
  EXPECT_NE(s.find("2x the reference's over 16 oracle samples"), std::string::npos) << s;
  EXPECT_NE(s.find(">= 3 against 1.35x"), std::string::npos) << s;
}

// The real CPU engine, one shape class per traffic model: the clean custom path never trips, the
// bf16 P·V accumulator trips within the window.
RandomBundleSpec Spec(Traffic traffic) {
  RandomBundleSpec s;
  s.batch = 1;
  s.heads = 8;
  s.draft = 4;
  s.prefix = 512;
  s.page_size = 16;
  s.traffic = traffic;
  s.seed = 77;
  return s;
}

TEST(DriftTestOnCpuEngine, CleanCustomPathNeverTrips) {
  auto engine = MakeCpuEngine(2);
  for (Traffic traffic : {Traffic::kRandom, Traffic::kRealistic}) {
    const auto s = testing::OracleStream(*engine, Spec(traffic), 64);
    ASSERT_EQ(s.size(), 64u);
    DriftTest t({});
    for (const auto& o : s) {
      EXPECT_FALSE(t.Add(o.custom_vs_oracle, o.reference_vs_oracle).breach)
          << TrafficName(traffic) << ": " << DescribeDrift(t.Reading(), t.options());
    }
  }
}

TEST(DriftTestOnCpuEngine, Bf16AccumulatorTripsWithinTheWindow) {
  auto engine = MakeCpuEngine(2);
  engine->InjectCustomFault({CustomFault::Kind::kBf16Pv, 0});
  const DriftOptions o;
  const auto s = testing::OracleStream(*engine, Spec(Traffic::kRandom), o.window);
  ASSERT_EQ(s.size(), static_cast<size_t>(o.window));
  DriftTest t(o);
  int first = -1;
  for (size_t i = 0; i < s.size() && first < 0; ++i) {
    if (t.Add(s[i].custom_vs_oracle, s[i].reference_vs_oracle).breach) first = i + 1;
  }
  EXPECT_EQ(first, o.min_samples) << DescribeDrift(t.Reading(), t.options());
}

}  // namespace
}  // namespace verifyd
