#pragma once
// The admin bearer token file, read the same way by verifyd and verifyctl: one line of printable
// ASCII (a gRPC header value), surrounding whitespace and the trailing newline stripped. Like
// ssh with a private key, the daemon refuses a file that group or others can access.

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace verifyd {

// `flag` names the flag in errors. `private_file`: refuse group/other permissions.
inline absl::StatusOr<std::string> ReadAdminTokenFile(const std::string& flag,
                                                      const std::string& path, bool private_file) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  if (private_file && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: %s has mode %04o: a token file must not be accessible by group or others "
        "(chmod 600 %s)",
        flag, path, st.st_mode & 07777, path));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s: the token has byte 0x%02x at offset %d; a token is one line of printable "
          "ASCII",
          flag, path, c, i));
    }
  }
  return token;
}

}  // namespace verifyd
