#pragma once
// This machine's host name ("" when it has none).

#include <unistd.h>

#include <string>

namespace verifyd {

inline std::string HostName() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

}  // namespace verifyd
