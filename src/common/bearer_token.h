#pragma once
// The admin bearer token, read from a file: surrounding whitespace (a trailing newline) is
// dropped; anything else that cannot travel in an HTTP/2 header value is refused.

#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace verifyd {

// INVALID_ARGUMENT naming `flag` when the token is empty or holds a control character (an inner
// newline, for example), NOT_FOUND when the file cannot be read.
inline absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& flag,
                                                       const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": ", path, " holds a control or non-ASCII character (byte 0x",
          absl::Hex(c, absl::kZeroPad2), " at offset ", i, " of the token",
          "); the token must be one line of printable ASCII"));
    }
  }
  return token;
}

}  // namespace verifyd
