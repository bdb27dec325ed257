#pragma once
// A PEM file a flag names (a TLS certificate chain, key or CA, for verifyd and for verifyctl):
// its text, or an error naming the flag and the path.

#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace verifyd {

inline absl::StatusOr<std::string> ReadPemFile(const char* flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM block"));
  }
  return ss.str();
}

}  // namespace verifyd
