#include "src/transport/unix_socket_acceptor.h"

#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace verifyd {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<ListeningUnixSocket> ListenUnixSocket(const std::string& flag,
                                                     const std::string& path,
                                                     const SocketAccess& access, int type) {
  ListeningUnixSocket s;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": unix socket path '", path,
                                                   "' must have 1 to ", sizeof addr.sun_path - 1,
                                                   " characters"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  s.fd = UniqueFd(::socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
  if (!s.fd.valid()) return Errno(absl::StrCat(flag, ": socket"));
  // Linux creates the socket file with the socket's own mode less the umask: set before bind,
  // the file is never looser than asked, even for an instant under umask 0.
  if (::fchmod(s.fd.get(), access.mode) != 0) {
    return Errno(absl::StrFormat("%s: fchmod %04o", flag, access.mode));
  }
  if (::bind(s.fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    return Errno(absl::StrCat(flag, ": could not bind unix:", path));
  }
  // Exactly the mode (the umask may have taken bits away) and group, before anyone can connect.
  if (!access.group.empty()) {
    const group* gr = ::getgrnam(access.group.c_str());
    if (gr == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": group '", access.group, "' does not exist"));
    }
    if (::chown(path.c_str(), static_cast<uid_t>(-1), gr->gr_gid) != 0) {
      return Errno(absl::StrCat(flag, ": chgrp ", access.group, " ", path));
    }
  }
  if (::chmod(path.c_str(), access.mode) != 0) {
    return Errno(absl::StrFormat("%s: chmod %04o %s", flag, access.mode, path));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Errno(absl::StrCat(flag, ": stat ", path));
  s.inode = st.st_ino;
  if (::listen(s.fd.get(), 64) != 0) return Errno(absl::StrCat(flag, ": listen ", path));
  return s;
}

void RemoveUnixSocket(const std::string& path, unsigned long inode) {
  struct stat st {};
  if (inode != 0 && ::stat(path.c_str(), &st) == 0 && st.st_ino == inode) ::unlink(path.c_str());
}

absl::StatusOr<std::unique_ptr<UnixSocketAcceptor>> UnixSocketAcceptor::Start(
    const std::string& flag, const std::string& path, grpc::Server* server,
    const SocketAccess& access) {
  std::unique_ptr<UnixSocketAcceptor> a(new UnixSocketAcceptor);
  a->flag_ = flag;
  a->path_ = path;
  a->server_ = server;
  absl::StatusOr<ListeningUnixSocket> s = ListenUnixSocket(flag, path, access, SOCK_STREAM);
  if (!s.ok()) return s.status();
  a->listening_ = std::move(*s);
  a->wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (a->wake_fd_ < 0) return Errno(absl::StrCat(flag, ": eventfd"));
  a->thread_ = std::thread([p = a.get()] { p->Loop(); });
  return a;
}

void UnixSocketAcceptor::Loop() {
  for (;;) {
    pollfd fds[2] = {{listening_.fd.get(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("{}: poll: {}", flag_, std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listening_.fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("{}: accept: {}", flag_, std::strerror(errno));
      }
      continue;
    }
    grpc::AddInsecureChannelFromFd(server_, fd);  // gRPC owns and closes fd
  }
}

UnixSocketAcceptor::~UnixSocketAcceptor() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) != sizeof one) {
      spdlog::error("{}: cannot stop the acceptor: {}", flag_, std::strerror(errno));
    }
    thread_.join();
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
  listening_.fd.Reset();
  RemoveUnixSocket(path_, listening_.inode);
}

namespace {

std::optional<ucred> UnixPeerCred(const std::string& peer_string) {
  // The call arrived on this connection, so the descriptor is still open and is the one gRPC
  // named: gRPC closes it only after the connection's calls are gone.
  absl::string_view peer = peer_string;
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd) || fd < 0) {
    return std::nullopt;
  }
  int domain = 0;
  socklen_t len = sizeof domain;
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || domain != AF_UNIX) {
    return std::nullopt;
  }
  ucred cred{};
  len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return std::nullopt;
  return cred;
}

}  // namespace

std::optional<uint32_t> UnixPeerUid(const std::string& peer) {
  const std::optional<ucred> cred = UnixPeerCred(peer);
  if (!cred) return std::nullopt;
  return cred->uid;
}

std::optional<int> UnixPeerPid(const std::string& peer) {
  const std::optional<ucred> cred = UnixPeerCred(peer);
  if (!cred || cred->pid <= 0) return std::nullopt;
  return cred->pid;
}

std::optional<std::string> UnixPeerIdentity(const std::string& peer) {
  const std::optional<uint32_t> uid = UnixPeerUid(peer);
  if (!uid) return std::nullopt;
  std::string name;
  passwd pw{};
  passwd* found = nullptr;
  char buf[1024];
  if (::getpwuid_r(*uid, &pw, buf, sizeof buf, &found) == 0 && found != nullptr) {
    name = found->pw_name;
  }
  return name.empty() ? absl::StrCat("uid:", *uid) : absl::StrCat("uid:", *uid, "(", name, ")");
}

}  // namespace verifyd
