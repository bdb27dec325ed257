#include "src/fleet/desired_state.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "src/fleet/json_fields.h"

namespace verifyd::fleet {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

absl::StatusOr<Mode> ModeField(const Json& j, absl::string_view field) {
  return ModeFromJson(j, field);
}

absl::StatusOr<double> FractionField(const Json& j, absl::string_view field, bool zero_ok) {
  if (!j.is_number()) return Bad(field, "must be a number");
  const double f = j.get<double>();
  if (!std::isfinite(f) || f > 1 || f < 0 || (!zero_ok && f == 0)) {
    return Bad(field, absl::StrCat(f, " is outside ", zero_ok ? "[0, 1]" : "(0, 1]"));
  }
  return f;
}

absl::Status ParseStep(const Json& j, DesiredState* s) {
  if (!j.is_object()) return Bad("step", "must be an object with 'fraction' or 'nodes'");
  for (const auto& [key, value] : j.items()) {
    if (key == "fraction") {
      absl::StatusOr<double> f = FractionField(value, "step.fraction", true);
      if (!f.ok()) return f.status();
      s->step_fraction = *f;
    } else if (key == "nodes") {
      if (!value.is_array()) return Bad("step.nodes", "must be an array of node names");
      for (const Json& n : value) {
        if (!n.is_string() || n.get<std::string>().empty()) {
          return Bad("step.nodes", "every entry must be a non-empty node name");
        }
        s->step_nodes.push_back(n.get<std::string>());
      }
    } else {
      return Bad(absl::StrCat("step.", key), "unknown field (fraction, nodes)");
    }
  }
  if (s->step_fraction.has_value() && !s->step_nodes.empty()) {
    return Bad("step", "give 'fraction' or 'nodes', not both");
  }
  if (!s->step_fraction.has_value() && s->step_nodes.empty()) {
    return Bad("step", "give 'fraction' or a non-empty 'nodes'");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DesiredState> ParseDesiredState(std::string_view json) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("desired state", "not JSON (a file caught half written?)");
  if (!j.is_object()) return Bad("desired state", "must be a JSON object");
  DesiredState s;
  bool has_generation = false, has_mode = false, has_fraction = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "generation") {
      if (!value.is_number_integer() || value.get<int64_t>() < 1) {
        return Bad("generation", "must be an integer >= 1");
      }
      s.generation = value.get<int64_t>();
      has_generation = true;
    } else if (key == "mode") {
      absl::StatusOr<Mode> m = ModeField(value, "mode");
      if (!m.ok()) return m.status();
      s.mode = *m;
      has_mode = true;
    } else if (key == "canary_fraction") {
      absl::StatusOr<double> f = FractionField(value, "canary_fraction", false);
      if (!f.ok()) return f.status();
      s.canary_fraction = *f;
      has_fraction = true;
    } else if (key == "build") {
      if (!value.is_string()) return Bad("build", "must be a string (the build's commit)");
      s.build = value.get<std::string>();
    } else if (key == "step") {
      if (absl::Status st = ParseStep(value, &s); !st.ok()) return st;
    } else if (key == "stable_mode") {
      absl::StatusOr<Mode> m = ModeField(value, "stable_mode");
      if (!m.ok()) return m.status();
      if (ServesCustom(*m)) {
        return Bad("stable_mode", "must not serve the custom kernel (reference or shadow)");
      }
      s.stable_mode = *m;
    } else if (key == "reason") {
      if (!value.is_string()) return Bad("reason", "must be a string");
      s.reason = value.get<std::string>();
    } else {
      return Bad(key,
                 "unknown field (generation, mode, canary_fraction, build, step, stable_mode, "
                 "reason)");
    }
  }
  if (!has_generation) return Bad("generation", "missing");
  if (!has_mode) return Bad("mode", "missing");
  if (s.mode == Mode::kCanary && !has_fraction) {
    return Bad("canary_fraction", "missing: canary needs a fraction in (0, 1]");
  }
  if (s.mode != Mode::kCanary && has_fraction) {
    return Bad("canary_fraction",
               absl::StrCat("given for mode ", ModeName(s.mode), "; only canary takes one"));
  }
  return s;
}

std::string SerializeDesiredState(const DesiredState& s) {
  Json j = Json::object();
  j["generation"] = s.generation;
  j["mode"] = ModeName(s.mode);
  if (s.mode == Mode::kCanary) j["canary_fraction"] = s.canary_fraction;
  if (!s.build.empty()) j["build"] = s.build;
  if (s.step_fraction) {
    j["step"] = {{"fraction", *s.step_fraction}};
  } else if (!s.step_nodes.empty()) {
    j["step"] = {{"nodes", s.step_nodes}};
  }
  j["stable_mode"] = ModeName(s.stable_mode);
  if (!s.reason.empty()) j["reason"] = s.reason;
  return j.dump();
}

double NodeHashFraction(std::string_view node) {
  uint64_t h = 14695981039346656037ull;
  for (const char c : node) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  // FNV-1a's last bytes reach only its low and middle bits (a byte's change moves the top bits
  // by about 2^-24 of the space), so names that differ in their last characters (node-0 ...
  // node-7) fall together; the finalizer spreads every bit over the top ones.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return static_cast<double>(h >> 11) / static_cast<double>(uint64_t{1} << 53);
}

bool InStep(const DesiredState& s, std::string_view node) {
  if (s.step_fraction) return NodeHashFraction(node) < *s.step_fraction;
  if (!s.step_nodes.empty()) {
    for (const std::string& n : s.step_nodes) {
      if (n == node) return true;
    }
    return false;
  }
  return true;
}

NodeTarget TargetFor(const DesiredState& s, std::string_view node) {
  if (!InStep(s, node)) return {s.stable_mode, 0};
  return {s.mode, s.mode == Mode::kCanary ? s.canary_fraction : 0};
}

}  // namespace verifyd::fleet
