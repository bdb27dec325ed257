#include "src/fleet/rollout_plan.h"

#include <cmath>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "src/fleet/json_fields.h"

namespace verifyd::fleet {
namespace {

using Json = nlohmann::json;

absl::Status PlanBad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("rollout plan: ", field, ": ", why));
}

absl::StatusOr<std::string> StringField(const Json& j, absl::string_view field, bool empty_ok) {
  if (!j.is_string()) return PlanBad(field, "must be a string");
  if (!empty_ok && j.get<std::string>().empty()) return PlanBad(field, "must not be empty");
  return j.get<std::string>();
}

absl::StatusOr<double> NumberField(const Json& j, absl::string_view field) {
  if (!j.is_number()) return PlanBad(field, "must be a number");
  const double v = j.get<double>();
  if (!std::isfinite(v)) return PlanBad(field, "must be finite");
  return v;
}

// Seconds > 0 (at most a day), as a duration.
absl::StatusOr<absl::Duration> SecondsField(const Json& j, absl::string_view field) {
  absl::StatusOr<double> v = NumberField(j, field);
  if (!v.ok()) return v.status();
  if (*v <= 0 || *v > 86400)
    return PlanBad(field, absl::StrCat(*v, " is outside (0, 86400] seconds"));
  return absl::Seconds(*v);
}

absl::StatusOr<Mode> PlanMode(const Json& j, absl::string_view field) {
  absl::StatusOr<Mode> m = ModeFromJson(j, field);
  if (!m.ok())
    return absl::InvalidArgumentError(absl::StrCat("rollout plan: ", m.status().message()));
  return m;
}

absl::Status ParseSteps(const Json& j, RolloutPlan* p) {
  if (!j.is_array() || j.empty()) return PlanBad("steps", "must be a non-empty array of fractions");
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string field = absl::StrCat("steps[", i, "]");
    absl::StatusOr<double> f = NumberField(j[i], field);
    if (!f.ok()) return f.status();
    if (*f <= 0 || *f > 1) return PlanBad(field, absl::StrCat(*f, " is outside (0, 1]"));
    if (!p->steps.empty() && *f <= p->steps.back()) {
      return PlanBad(field, absl::StrCat(*f, " is not above the step before it (", p->steps.back(),
                                         "): steps only widen"));
    }
    p->steps.push_back(*f);
  }
  return absl::OkStatus();
}

absl::Status ParseQueries(const Json& j, RolloutPlan* p) {
  if (!j.is_array() || j.empty()) {
    return PlanBad("queries", "must be a non-empty array of {name, query, min and/or max}");
  }
  std::set<std::string> names;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = absl::StrCat("queries[", i, "]");
    if (!j[i].is_object()) return PlanBad(at, "must be an object {name, query, min and/or max}");
    AnalysisQuery q;
    for (const auto& [key, value] : j[i].items()) {
      const std::string field = absl::StrCat(at, ".", key);
      if (key == "name" || key == "query") {
        absl::StatusOr<std::string> s = StringField(value, field, false);
        if (!s.ok()) return s.status();
        (key == "name" ? q.name : q.query) = *s;
      } else if (key == "min" || key == "max") {
        absl::StatusOr<double> v = NumberField(value, field);
        if (!v.ok()) return v.status();
        (key == "min" ? q.min : q.max) = *v;
      } else {
        return PlanBad(field, "unknown field (name, query, min, max)");
      }
    }
    if (q.name.empty()) return PlanBad(absl::StrCat(at, ".name"), "missing");
    if (q.query.empty()) return PlanBad(absl::StrCat(at, ".query"), "missing");
    if (!q.min && !q.max) return PlanBad(at, "give 'min', 'max' or both");
    if (q.min && q.max && *q.min > *q.max) {
      return PlanBad(at, absl::StrCat("min ", *q.min, " is above max ", *q.max));
    }
    if (!names.insert(q.name).second) {
      return PlanBad(absl::StrCat(at, ".name"), absl::StrCat("'", q.name, "' is given twice"));
    }
    p->queries.push_back(std::move(q));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RolloutPlan> ParseRolloutPlan(std::string_view json) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return PlanBad("file", "not JSON");
  if (!j.is_object()) return PlanBad("file", "must be a JSON object");
  RolloutPlan p;
  bool has_mode = false, has_fraction = false, has_duration = false, has_interval = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      absl::StatusOr<std::string> s = StringField(value, key, false);
      if (!s.ok()) return s.status();
      p.name = *s;
    } else if (key == "mode") {
      absl::StatusOr<Mode> m = PlanMode(value, key);
      if (!m.ok()) return m.status();
      if (!ServesCustom(*m)) return PlanBad(key, "must serve the custom kernel (canary or custom)");
      p.mode = *m;
      has_mode = true;
    } else if (key == "canary_fraction") {
      absl::StatusOr<double> f = NumberField(value, key);
      if (!f.ok()) return f.status();
      if (*f <= 0 || *f > 1) return PlanBad(key, absl::StrCat(*f, " is outside (0, 1]"));
      p.canary_fraction = *f;
      has_fraction = true;
    } else if (key == "build") {
      absl::StatusOr<std::string> s = StringField(value, key, true);
      if (!s.ok()) return s.status();
      p.build = *s;
    } else if (key == "stable_mode") {
      absl::StatusOr<Mode> m = PlanMode(value, key);
      if (!m.ok()) return m.status();
      if (ServesCustom(*m)) {
        return PlanBad(key, "must not serve the custom kernel (reference or shadow)");
      }
      p.stable_mode = *m;
    } else if (key == "steps") {
      if (absl::Status st = ParseSteps(value, &p); !st.ok()) return st;
    } else if (key == "step_duration_s" || key == "analysis_interval_s" ||
               key == "settle_timeout_s") {
      absl::StatusOr<absl::Duration> d = SecondsField(value, key);
      if (!d.ok()) return d.status();
      if (key == "step_duration_s") {
        p.step_duration = *d;
        has_duration = true;
      } else if (key == "analysis_interval_s") {
        p.analysis_interval = *d;
        has_interval = true;
      } else {
        p.settle_timeout = *d;
      }
    } else if (key == "prometheus") {
      absl::StatusOr<std::string> s = StringField(value, key, false);
      if (!s.ok()) return s.status();
      if (s->rfind("http://", 0) != 0) return PlanBad(key, "must be a URL http://host:port");
      p.prometheus = *s;
    } else if (key == "queries") {
      if (absl::Status st = ParseQueries(value, &p); !st.ok()) return st;
    } else {
      return PlanBad(
          key,
          "unknown field (name, mode, canary_fraction, build, stable_mode, steps, "
          "step_duration_s, analysis_interval_s, settle_timeout_s, prometheus, queries)");
    }
  }
  if (p.name.empty()) return PlanBad("name", "missing");
  if (!has_mode) return PlanBad("mode", "missing");
  if (p.mode == Mode::kCanary && !has_fraction) {
    return PlanBad("canary_fraction", "missing: canary needs a fraction in (0, 1]");
  }
  if (p.mode != Mode::kCanary && has_fraction) {
    return PlanBad("canary_fraction",
                   absl::StrCat("given for mode ", ModeName(p.mode), "; only canary takes one"));
  }
  if (p.steps.empty()) return PlanBad("steps", "missing");
  if (!has_duration) return PlanBad("step_duration_s", "missing");
  if (!has_interval) return PlanBad("analysis_interval_s", "missing");
  if (p.analysis_interval > p.step_duration) {
    return PlanBad("analysis_interval_s", "must not be longer than step_duration_s");
  }
  if (p.queries.empty()) return PlanBad("queries", "missing");
  return p;
}

std::string SerializeRolloutPlan(const RolloutPlan& p) {
  Json j = Json::object();
  j["name"] = p.name;
  j["mode"] = ModeName(p.mode);
  if (p.mode == Mode::kCanary) j["canary_fraction"] = p.canary_fraction;
  if (!p.build.empty()) j["build"] = p.build;
  j["stable_mode"] = ModeName(p.stable_mode);
  j["steps"] = p.steps;
  j["step_duration_s"] = absl::ToDoubleSeconds(p.step_duration);
  j["analysis_interval_s"] = absl::ToDoubleSeconds(p.analysis_interval);
  j["settle_timeout_s"] = absl::ToDoubleSeconds(p.settle_timeout);
  if (!p.prometheus.empty()) j["prometheus"] = p.prometheus;
  Json queries = Json::array();
  for (const AnalysisQuery& q : p.queries) {
    Json o = {{"name", q.name}, {"query", q.query}};
    if (q.min) o["min"] = *q.min;
    if (q.max) o["max"] = *q.max;
    queries.push_back(std::move(o));
  }
  j["queries"] = std::move(queries);
  return j.dump();
}

}  // namespace verifyd::fleet
