#pragma once
// Oracle drift: whether the custom path is systematically further from the oracle (the exact
// answer) than the reference is, even while every call is within the per-call tolerances. A
// precision loss such as a P·V accumulator kept in bf16 shows only this way.
//
// Every sampled oracle run gives c and r, the rel-L2 of custom and of the reference against the
// oracle, and x = ln((c + floor) / (r + floor)). Over the last `window` samples the test is the
// one-sided t-test of
//   H0: mean(x) <= ln(max_ratio)   (custom's error is at most max_ratio times the reference's)
//   t = (mean(x) - ln(max_ratio)) / (sd(x) / sqrt(n)),   sd(x) at least min_sd,
// evaluated after every sample: a breach when n >= min_samples and t >= min_t. The reading's
// ratio, exp(mean(x)), is the geometric mean of custom's error over the reference's.
// The defaults come from measured clean and bf16-accumulating streams (README, "Oracle drift").

#include <cstdint>
#include <deque>
#include <limits>
#include <string>

#include "absl/status/status.h"

namespace verifyd {

struct DriftOptions {
  int64_t window = 64;       // oracle samples in the sliding window
  int64_t min_samples = 16;  // no verdict on fewer
  double max_ratio = 1.35;   // H0: custom's error is at most this times the reference's
  double min_t = 3;          // one-sided t statistic at which H0 is rejected
  double min_sd = 0.05;      // floor of sd(x), so that a few identical samples cannot give t = inf
  double floor = 1e-6;       // added to both rel-L2 values (an exact row has rel-L2 0)
};

// INVALID_ARGUMENT naming the flag when an option is out of range.
absl::Status ValidateDriftOptions(const DriftOptions& o);

struct DriftReading {
  int64_t samples = 0;                                      // in the window
  double ratio = std::numeric_limits<double>::quiet_NaN();  // geometric mean of c / r
  double t = std::numeric_limits<double>::quiet_NaN();      // NaN below min_samples
  bool breach = false;
};

// "custom's error vs the oracle is 2.31x the reference's over 16 samples (t 7.2 >= 3 against
// 1.35x)".
std::string DescribeDrift(const DriftReading& r, const DriftOptions& o);

class DriftTest {
 public:
  explicit DriftTest(const DriftOptions& o) : opts_(o) {}

  // Adds one oracle sample and returns the reading after it. A sample with a non-finite or
  // negative value is not added (NaN/Inf outputs are breaches of their own).
  DriftReading Add(double custom_vs_oracle, double reference_vs_oracle);
  DriftReading Reading() const { return reading_; }
  const DriftOptions& options() const { return opts_; }

 private:
  DriftReading Evaluate() const;

  const DriftOptions opts_;
  std::deque<double> x_;  // ln ratios, oldest first
  DriftReading reading_;
};

}  // namespace verifyd
