#pragma once
// Which build of verifyd, with which custom-kernel configuration, is running. state.json binds
// the flip to canary/custom and the flip gate's evidence to it: a different build must earn the
// gate again.

#include <string>
#include <string_view>

namespace verifyd {

struct BuildIdentity {
  std::string version;             // VERIFYD_VERSION
  std::string commit;              // VERIFYD_GIT_COMMIT
  std::string custom_config_hash;  // ConfigFingerprint() of what shapes the custom path's output

  bool operator==(const BuildIdentity& o) const {
    return version == o.version && commit == o.commit && custom_config_hash == o.custom_config_hash;
  }
  bool operator!=(const BuildIdentity& o) const { return !(*this == o); }
  bool empty() const { return version.empty() && commit.empty() && custom_config_hash.empty(); }
  // "0.4.0 (abc1234, config 9e3f0c2a11d4b6e7)"; "an unrecorded build" when empty.
  std::string ToString() const;
};

// A stable 16-hex-digit fingerprint (FNV-1a 64) of a canonical description of the custom
// path's configuration, identical across processes and machines.
std::string ConfigFingerprint(std::string_view canonical_description);

}  // namespace verifyd
