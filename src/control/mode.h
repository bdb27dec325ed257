#pragma once
// The serving modes (docs/operations.md, "Modes and the flip") and their names.

#include <optional>
#include <string>
#include <string_view>

namespace verifyd {

enum class Mode { kReference = 0, kShadow = 1, kCanary = 2, kCustom = 3 };

inline const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kReference:
      return "reference";
    case Mode::kShadow:
      return "shadow";
    case Mode::kCanary:
      return "canary";
    case Mode::kCustom:
      return "custom";
  }
  return "unknown";
}

inline std::optional<Mode> ParseMode(std::string_view s) {
  for (Mode m : {Mode::kReference, Mode::kShadow, Mode::kCanary, Mode::kCustom}) {
    if (s == ModeName(m)) return m;
  }
  return std::nullopt;
}

// Modes that serve the custom path on some calls: the gate guards them, rollback leaves them.
inline bool ServesCustom(Mode m) { return m == Mode::kCanary || m == Mode::kCustom; }

}  // namespace verifyd
