#pragma once
// PromQL instant queries over Prometheus's HTTP API (POST /api/v1/query), for the rollout
// controller's analysis, and the verdict of one query against its plan's bounds.

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/fleet/rollout_plan.h"

namespace verifyd::fleet {

// One sample of a query's result: its labels ("{instance="a:9464"}", or "" for a scalar or a
// series without labels) and value (NaN and ±Inf as Prometheus wrote them).
struct PromSample {
  std::string labels;
  double value = 0;
};

// The samples of an /api/v1/query response body (a vector or a scalar); the error Prometheus
// gave (INVALID_ARGUMENT for a bad query) or INTERNAL for a body that is not such a response.
absl::StatusOr<std::vector<PromSample>> ParsePromResponse(std::string_view body);

// `base_url`: http://host:port[/path]. UNAVAILABLE when Prometheus does not answer.
absl::StatusOr<std::vector<PromSample>> PromQuery(const std::string& base_url,
                                                  const std::string& query, absl::Duration timeout);

// A query's verdict: it passes when it returned at least one sample and every sample is within
// the bounds; `value` is the worst sample (the one furthest outside, else the largest).
struct QueryVerdict {
  bool pass = false;
  std::string detail;  // "breach_rate = 0.25 (max 0.001) {instance=...}" or the error
};
QueryVerdict Judge(const AnalysisQuery& q, const absl::StatusOr<std::vector<PromSample>>& result);

}  // namespace verifyd::fleet
