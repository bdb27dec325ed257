#include "src/control/drift_test.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace verifyd {

absl::Status ValidateDriftOptions(const DriftOptions& o) {
  if (o.window < 2) return absl::InvalidArgumentError("drift_window: must be >= 2");
  if (o.min_samples < 2 || o.min_samples > o.window) {
    return absl::InvalidArgumentError("drift_min_samples: must be in [2, drift_window]");
  }
  if (!(o.max_ratio >= 1) || !std::isfinite(o.max_ratio)) {
    return absl::InvalidArgumentError("drift_max_ratio: must be a finite number >= 1");
  }
  if (!(o.min_t > 0) || !std::isfinite(o.min_t)) {
    return absl::InvalidArgumentError("drift_min_t: must be a finite number > 0");
  }
  if (!(o.min_sd > 0) || !(o.floor > 0)) {
    return absl::InvalidArgumentError("drift: min_sd and floor must be > 0");
  }
  return absl::OkStatus();
}

std::string DescribeDrift(const DriftReading& r, const DriftOptions& o) {
  if (r.samples == 0) return "no oracle samples yet";
  std::string s = absl::StrFormat(
      "custom's error vs the oracle is %.3gx the reference's over %d oracle samples", r.ratio,
      r.samples);
  if (std::isnan(r.t)) {
    return s + absl::StrFormat(" (no verdict before %d)", o.min_samples);
  }
  return s + absl::StrFormat(" (t %.3g %s %g against %gx)", r.t, r.breach ? ">=" : "<", o.min_t,
                             o.max_ratio);
}

DriftReading DriftTest::Add(double custom_vs_oracle, double reference_vs_oracle) {
  if (std::isfinite(custom_vs_oracle) && std::isfinite(reference_vs_oracle) &&
      custom_vs_oracle >= 0 && reference_vs_oracle >= 0) {
    x_.push_back(std::log((custom_vs_oracle + opts_.floor) / (reference_vs_oracle + opts_.floor)));
    while (static_cast<int64_t>(x_.size()) > opts_.window) x_.pop_front();
    reading_ = Evaluate();
  }
  return reading_;
}

DriftReading DriftTest::Evaluate() const {
  DriftReading r;
  r.samples = static_cast<int64_t>(x_.size());
  if (x_.empty()) return r;
  const double n = static_cast<double>(x_.size());
  double sum = 0;
  for (double x : x_) sum += x;
  const double mean = sum / n;
  r.ratio = std::exp(mean);
  if (r.samples < opts_.min_samples) return r;
  double ss = 0;
  for (double x : x_) ss += (x - mean) * (x - mean);
  const double sd = std::max(opts_.min_sd, std::sqrt(ss / (n - 1)));
  r.t = (mean - std::log(opts_.max_ratio)) / (sd / std::sqrt(n));
  r.breach = r.t >= opts_.min_t;
  return r;
}

}  // namespace verifyd
