#pragma once
// Mode <-> verifyd.v1.Mode: the proto enum is the C++ one shifted past MODE_UNSPECIFIED.

#include <optional>

#include "src/control/mode.h"
#include "verifyd/v1/types.pb.h"

namespace verifyd {

inline v1::Mode ModeToProto(Mode m) { return static_cast<v1::Mode>(static_cast<int>(m) + 1); }

// nullopt for MODE_UNSPECIFIED or an unknown value.
inline std::optional<Mode> ModeFromProto(v1::Mode m) {
  if (m < v1::MODE_REFERENCE || m > v1::MODE_CUSTOM) return std::nullopt;
  return static_cast<Mode>(static_cast<int>(m) - 1);
}

}  // namespace verifyd
