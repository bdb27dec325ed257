// The JSON text of state.json and of audit.jsonl lines: pure functions, no files.

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "src/control/state_store.h"

namespace verifyd {
namespace {

using nlohmann::json;

// Invalid UTF-8 in a client-sent name or reason is replaced, never a throw.
std::string Dump(const json& j, int indent) {
  return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

absl::Status WrongType(const std::string& field, const char* want, const json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be ", want, ", not ", got.type_name()));
}

// Each reader leaves *out alone when the key is absent (the field's default stays).
absl::Status Read(const json& j, const char* key, const std::string& field, std::string* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_string()) return WrongType(field, "a string", *it);
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status Read(const json& j, const char* key, const std::string& field, double* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_number()) return WrongType(field, "a number", *it);
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status Read(const json& j, const char* key, const std::string& field, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", it->dump(), " is too large"));
  }
  if (!it->is_number_integer()) return WrongType(field, "an integer", *it);
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status Read(const json& j, const char* key, const std::string& field, bool* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_boolean()) return WrongType(field, "true or false", *it);
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status Read(const json& j, const char* key, const std::string& field, Mode* out) {
  std::string name;
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (absl::Status st = Read(j, key, field, &name); !st.ok()) return st;
  std::optional<Mode> m = ParseMode(name);
  if (!m) return absl::InvalidArgumentError(absl::StrCat(field, ": unknown mode ", it->dump()));
  *out = *m;
  return absl::OkStatus();
}

absl::Status Read(const json& j, const char* key, const std::string& field, BuildIdentity* out) {
  auto it = j.find(key);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_object()) return WrongType(field, "an object", *it);
  const std::string f(field);
  for (absl::Status st :
       {Read(*it, "version", f + ".version", &out->version),
        Read(*it, "commit", f + ".commit", &out->commit),
        Read(*it, "custom_config_hash", f + ".custom_config_hash", &out->custom_config_hash)}) {
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

json BuildJson(const BuildIdentity& b) {
  return {
      {"version", b.version}, {"commit", b.commit}, {"custom_config_hash", b.custom_config_hash}};
}

absl::StatusOr<json> ParseObject(std::string_view text) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  return j;
}

absl::Status RateInRange(const std::string& field, double v) {
  if (std::isfinite(v) && v >= 0 && v <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", v, " must be in [0, 1]"));
}

}  // namespace

absl::Status ValidateState(const PersistedState& s) {
  if (!(std::isfinite(s.canary_fraction) && s.canary_fraction > 0 && s.canary_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("canary_fraction: ", s.canary_fraction, " must be in (0, 1]"));
  }
  if (absl::Status st = RateInRange("shadow_sample_rate", s.shadow_sample_rate); !st.ok())
    return st;
  if (absl::Status st = RateInRange("custom_sample_rate", s.custom_sample_rate); !st.ok())
    return st;
  if (s.gate.clean < 0) {
    return absl::InvalidArgumentError(absl::StrCat("gate.clean: ", s.gate.clean, " must be >= 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PersistedState> ParseState(std::string_view text) {
  absl::StatusOr<json> j = ParseObject(text);
  if (!j.ok()) return j.status();
  if (!j->contains("mode")) return absl::InvalidArgumentError("mode: missing");
  PersistedState s;
  json gate = j->value("gate", json::object());
  if (!gate.is_object()) return WrongType("gate", "an object", gate);
  for (absl::Status st : {
           Read(*j, "mode", "mode", &s.mode),
           Read(*j, "canary_fraction", "canary_fraction", &s.canary_fraction),
           Read(*j, "shadow_sample_rate", "shadow_sample_rate", &s.shadow_sample_rate),
           Read(*j, "custom_sample_rate", "custom_sample_rate", &s.custom_sample_rate),
           Read(*j, "custom_faulted", "custom_faulted", &s.custom_faulted),
           Read(*j, "custom_fault_reason", "custom_fault_reason", &s.custom_fault_reason),
           Read(*j, "build", "build", &s.build),
           Read(*j, "forced", "forced", &s.forced),
           Read(gate, "clean", "gate.clean", &s.gate.clean),
           Read(gate, "last_breach", "gate.last_breach", &s.gate.last_breach),
       }) {
    if (!st.ok()) return st;
  }
  if (absl::Status st = ValidateState(s); !st.ok()) return st;
  return s;
}

std::string SerializeState(const PersistedState& s) {
  json j = {{"mode", ModeName(s.mode)},
            {"canary_fraction", s.canary_fraction},
            {"shadow_sample_rate", s.shadow_sample_rate},
            {"custom_sample_rate", s.custom_sample_rate},
            {"custom_faulted", s.custom_faulted},
            {"custom_fault_reason", s.custom_fault_reason},
            {"build", BuildJson(s.build)},
            {"forced", s.forced},
            {"gate", {{"clean", s.gate.clean}, {"last_breach", s.gate.last_breach}}}};
  return Dump(j, 2) + "\n";
}

const char* AuditOriginName(AuditOrigin o) {
  switch (o) {
    case AuditOrigin::kUnknown:
      return "unknown";
    case AuditOrigin::kClient:
      return "client";
    case AuditOrigin::kDaemon:
      return "daemon";
  }
  return "unknown";
}

const char* AuditActionName(AuditAction a) {
  switch (a) {
    case AuditAction::kMode:
      return "mode";
    case AuditAction::kSampleRate:
      return "sample_rate";
    case AuditAction::kDenied:
      return "denied";
  }
  return "unknown";
}

absl::StatusOr<AuditEntry> ParseAuditLine(std::string_view line) {
  absl::StatusOr<json> j = ParseObject(line);
  if (!j.ok()) return j.status();
  AuditEntry e;
  std::string action = AuditActionName(e.action), origin = AuditOriginName(e.origin);
  for (absl::Status st : {
           Read(*j, "time", "time", &e.time),
           Read(*j, "action", "action", &action),
           Read(*j, "origin", "origin", &origin),
           Read(*j, "from", "from", &e.from),
           Read(*j, "to", "to", &e.to),
           Read(*j, "canary_fraction", "canary_fraction", &e.canary_fraction),
           Read(*j, "reason", "reason", &e.reason),
           Read(*j, "forced", "forced", &e.forced),
           Read(*j, "who", "who", &e.who),
           Read(*j, "peer", "peer", &e.peer),
           Read(*j, "build", "build", &e.build),
           Read(*j, "sample_mode", "sample_mode", &e.sample_mode),
           Read(*j, "sample_rate", "sample_rate", &e.sample_rate),
           Read(*j, "previous_sample_rate", "previous_sample_rate", &e.previous_sample_rate),
       }) {
    if (!st.ok()) return st;
  }
  if (action == "mode") {
    e.action = AuditAction::kMode;
  } else if (action == "sample_rate") {
    e.action = AuditAction::kSampleRate;
  } else if (action == "denied") {
    e.action = AuditAction::kDenied;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("action: unknown action \"", action, "\""));
  }
  if (origin == "client") {
    e.origin = AuditOrigin::kClient;
  } else if (origin == "daemon") {
    e.origin = AuditOrigin::kDaemon;
  } else if (origin == "unknown") {
    e.origin = AuditOrigin::kUnknown;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("origin: unknown origin \"", origin, "\""));
  }
  // Lines from before the fraction was recorded for canary only carry it for every target.
  if (e.action != AuditAction::kMode || e.to != Mode::kCanary) e.canary_fraction = 0;
  return e;
}

std::string SerializeAuditEntry(const AuditEntry& e) {
  json j = {{"time", e.time},
            {"action", AuditActionName(e.action)},
            {"origin", AuditOriginName(e.origin)},
            {"from", ModeName(e.from)},
            {"to", ModeName(e.to)}};
  if (e.action == AuditAction::kMode && e.to == Mode::kCanary) {
    j["canary_fraction"] = e.canary_fraction;
  }
  j["reason"] = e.reason;
  j["forced"] = e.forced;
  j["who"] = e.who;
  if (!e.peer.empty()) j["peer"] = e.peer;
  if (!e.build.empty()) j["build"] = BuildJson(e.build);
  if (e.action == AuditAction::kSampleRate) {
    j["sample_mode"] = ModeName(e.sample_mode);
    j["sample_rate"] = e.sample_rate;
    j["previous_sample_rate"] = e.previous_sample_rate;
  }
  return Dump(j, -1);
}

}  // namespace verifyd
