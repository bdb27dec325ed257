#include "src/fleet/prometheus_query.h"

#include <cmath>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "httplib.h"
#include "nlohmann/json.hpp"

namespace verifyd::fleet {
namespace {

using Json = nlohmann::json;

absl::StatusOr<double> SampleValue(const Json& pair) {
  if (!pair.is_array() || pair.size() != 2 || !pair[1].is_string()) {
    return absl::InternalError("prometheus: a sample is not [time, \"value\"]");
  }
  const std::string s = pair[1].get<std::string>();
  if (s == "NaN") return std::nan("");
  if (s == "+Inf") return HUGE_VAL;
  if (s == "-Inf") return -HUGE_VAL;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    return absl::InternalError(absl::StrCat("prometheus: '", s, "' is not a number"));
  }
  return v;
}

std::string Labels(const Json& metric) {
  if (!metric.is_object() || metric.empty()) return "";
  std::vector<std::string> parts;
  for (const auto& [k, v] : metric.items()) {
    parts.push_back(absl::StrCat(k, "=\"", v.is_string() ? v.get<std::string>() : v.dump(), "\""));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  return absl::StrCat(v);
}

}  // namespace

absl::StatusOr<std::vector<PromSample>> ParsePromResponse(std::string_view body) {
  Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("status")) {
    return absl::InternalError("prometheus: the answer is not an API response");
  }
  if (j["status"] != "success") {
    const std::string type = j.value("errorType", "error");
    const std::string error = j.value("error", "");
    return type == "bad_data"
               ? absl::InvalidArgumentError(absl::StrCat("prometheus: ", error))
               : absl::UnavailableError(absl::StrCat("prometheus: ", type, ": ", error));
  }
  const Json& data = j.contains("data") ? j["data"] : Json();
  if (!data.is_object() || !data.contains("resultType") || !data.contains("result")) {
    return absl::InternalError("prometheus: the answer has no data.result");
  }
  std::vector<PromSample> out;
  const Json& result = data["result"];
  if (data["resultType"] == "scalar") {
    absl::StatusOr<double> v = SampleValue(result);
    if (!v.ok()) return v.status();
    out.push_back({"", *v});
  } else if (data["resultType"] == "vector" && result.is_array()) {
    for (const Json& s : result) {
      if (!s.is_object() || !s.contains("value")) {
        return absl::InternalError("prometheus: a vector sample has no value");
      }
      absl::StatusOr<double> v = SampleValue(s["value"]);
      if (!v.ok()) return v.status();
      out.push_back({Labels(s.contains("metric") ? s["metric"] : Json()), *v});
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("prometheus: the query gives a ", data["resultType"].dump(),
                     "; the analysis needs an instant vector or a scalar"));
  }
  return out;
}

absl::StatusOr<std::vector<PromSample>> PromQuery(const std::string& base_url,
                                                  const std::string& query,
                                                  absl::Duration timeout) {
  if (!absl::StartsWith(base_url, "http://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("prometheus: '", base_url, "' is not http://host:port"));
  }
  const std::string rest = base_url.substr(7);
  const size_t slash = rest.find('/');
  const std::string host = rest.substr(0, slash);
  std::string path = slash == std::string::npos ? "" : rest.substr(slash);
  while (!path.empty() && path.back() == '/') path.pop_back();
  httplib::Client client(absl::StrCat("http://", host));
  const auto seconds = absl::ToInt64Seconds(timeout);
  const auto usec = absl::ToInt64Microseconds(timeout - absl::Seconds(seconds));
  client.set_connection_timeout(seconds, usec);
  client.set_read_timeout(seconds, usec);
  httplib::Result r =
      client.Post(absl::StrCat(path, "/api/v1/query"), httplib::Params{{"query", query}});
  if (!r) {
    return absl::UnavailableError(
        absl::StrCat("prometheus ", base_url, ": ", httplib::to_string(r.error())));
  }
  absl::StatusOr<std::vector<PromSample>> samples = ParsePromResponse(r->body);
  if (!samples.ok() && r->status != 200 && r->status != 400 && r->status != 422) {
    return absl::UnavailableError(absl::StrCat("prometheus ", base_url, ": HTTP ", r->status));
  }
  return samples;
}

QueryVerdict Judge(const AnalysisQuery& q, const absl::StatusOr<std::vector<PromSample>>& result) {
  if (!result.ok()) return {false, absl::StrCat(q.name, ": ", result.status().message())};
  if (result->empty()) return {false, absl::StrCat(q.name, ": no data (an empty result)")};
  std::string bounds;
  if (q.min) bounds = absl::StrCat("min ", *q.min);
  if (q.max) absl::StrAppend(&bounds, bounds.empty() ? "" : ", ", "max ", *q.max);
  // The sample furthest outside the bounds; while all are inside, the largest.
  const PromSample* worst = nullptr;
  double worst_excess = -HUGE_VAL;
  bool pass = true;
  for (const PromSample& s : *result) {
    double excess = -HUGE_VAL;
    bool inside = !std::isnan(s.value);
    if (!inside) excess = HUGE_VAL;
    if (inside && q.max && s.value > *q.max) {
      inside = false;
      excess = s.value - *q.max;
    }
    if (inside && q.min && s.value < *q.min) {
      inside = false;
      excess = *q.min - s.value;
    }
    if (inside) excess = -HUGE_VAL;
    pass = pass && inside;
    if (worst == nullptr || excess > worst_excess ||
        (excess == worst_excess && s.value > worst->value)) {
      worst = &s;
      worst_excess = excess;
    }
  }
  std::string detail = absl::StrCat(q.name, " = ", Number(worst->value), " (", bounds, ")");
  if (!worst->labels.empty()) absl::StrAppend(&detail, " ", worst->labels);
  if (result->size() > 1) absl::StrAppend(&detail, ", worst of ", result->size(), " series");
  return {pass, detail};
}

}  // namespace verifyd::fleet
