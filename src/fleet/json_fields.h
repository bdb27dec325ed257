#pragma once
// Fields of the fleet's JSON documents (the desired state, the rollout plan), read with the error
// a bad one gets: INVALID_ARGUMENT "FIELD: why".

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "src/control/mode.h"

namespace verifyd::fleet {

// A mode's name: reference, shadow, canary or custom.
absl::StatusOr<Mode> ModeFromJson(const nlohmann::json& j, absl::string_view field);

}  // namespace verifyd::fleet
