#include "src/control/build_identity.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace verifyd {

std::string BuildIdentity::ToString() const {
  if (empty()) return "an unrecorded build";
  return absl::StrCat(version, " (", commit, ", config ", custom_config_hash, ")");
}

std::string ConfigFingerprint(std::string_view canonical_description) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : canonical_description) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return absl::StrFormat("%016x", h);
}

}  // namespace verifyd
