#include "src/fleet/json_fields.h"

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace verifyd::fleet {

absl::StatusOr<Mode> ModeFromJson(const nlohmann::json& j, absl::string_view field) {
  constexpr absl::string_view kModes = "(reference, shadow, canary, custom)";
  if (!j.is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must be a mode name ", kModes));
  }
  std::optional<Mode> m = ParseMode(j.get<std::string>());
  if (!m) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", j.get<std::string>(), "' is not a mode ", kModes));
  }
  return *m;
}

}  // namespace verifyd::fleet
