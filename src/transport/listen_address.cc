#include "src/transport/listen_address.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace verifyd {
namespace {

// Closes a file descriptor when it goes out of scope.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string Errno(int e) { return std::strerror(e); }

}  // namespace

bool IsUnixAddress(const std::string& address) { return absl::StartsWith(address, "unix:"); }

absl::Status PrepareUnixSocketPath(const std::string& flag, const std::string& path) {
  const std::string where = absl::StrCat(flag, ": unix:", path);
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(parent, ec)) {
      std::filesystem::create_directories(parent, ec);
      if (ec) {
        return absl::FailedPreconditionError(absl::StrCat(where, ": cannot create the directory ",
                                                          parent.string(), ": ", ec.message()));
      }
      ::chmod(parent.c_str(), 0755);
    }
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(where, ": ", Errno(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, " exists and is not a socket; refusing to remove it"));
  }
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": path longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  Fd s{::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  if (s.fd < 0) return absl::InternalError(absl::StrCat(where, ": socket: ", Errno(errno)));
  if (::connect(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    std::string who = "another process";
    if (::getsockopt(s.fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.pid > 0) {
      who = absl::StrCat("pid ", cred.pid);
    }
    return absl::AlreadyExistsError(
        absl::StrCat(where, " is in use by ", who, " (it accepts connections)"));
  }
  if (errno != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": cannot tell whether the socket is in use (", Errno(errno),
                     "); refusing to remove it"));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": cannot remove the stale socket: ", Errno(errno)));
  }
  return absl::OkStatus();
}

namespace {

// Empty when HOST:PORT can be bound now.
std::string TcpBindProblem(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::StrCat(address, " is not HOST:PORT");
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
      rc != 0) {
    return absl::StrCat("cannot resolve ", address, ": ", ::gai_strerror(rc));
  }
  std::string why;
  for (addrinfo* a = res; a; a = a->ai_next) {
    Fd s{::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol)};
    if (s.fd < 0) continue;
    const int one = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // ignore TIME_WAIT
    if (::bind(s.fd, a->ai_addr, a->ai_addrlen) == 0) continue;
    why = errno == EADDRINUSE ? absl::StrCat(address, " is in use by another process")
                              : absl::StrCat("cannot bind ", address, ": ", Errno(errno));
    break;
  }
  ::freeaddrinfo(res);
  return why;
}

}  // namespace

absl::Status CheckTcpAddressFree(const std::string& flag, const std::string& address) {
  if (std::string why = TcpBindProblem(address); !why.empty()) {
    return absl::UnavailableError(absl::StrCat(flag, ": ", why));
  }
  return absl::OkStatus();
}

std::string BindFailure(const std::vector<std::string>& addresses) {
  for (const std::string& a : addresses) {
    if (IsUnixAddress(a)) continue;
    if (std::string why = TcpBindProblem(a); !why.empty()) return why;
  }
  return absl::StrCat("could not bind ", absl::StrJoin(addresses, ", "));
}

}  // namespace verifyd
