#pragma once
// A Unix-socket listener whose connections carry the client's kernel-verified identity.
//
// gRPC does not expose a Unix-socket client's credentials, so the acceptor accepts connections
// itself and hands each one to a gRPC server (grpc::AddInsecureChannelFromFd). Such a call's
// ServerContext::peer() is "fd:N"; UnixPeerIdentity() reads SO_PEERCRED from that socket.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "src/common/unique_fd.h"

namespace grpc {
class Server;
}

namespace verifyd {

// Who may connect: the socket file's mode and group.
struct SocketAccess {
  unsigned mode = 0600;
  std::string group;  // empty: the daemon's own group
};

// A Unix socket bound to a path and listening, with the file's inode (to remove only that file).
struct ListeningUnixSocket {
  UniqueFd fd;
  unsigned long inode = 0;
};

// Binds PATH (a socket of `type`, SOCK_STREAM or SOCK_SEQPACKET) and listens. The socket is never
// looser than `access.mode`, whatever the umask, and has exactly that mode and group before it
// listens. `flag` names the listener in errors.
absl::StatusOr<ListeningUnixSocket> ListenUnixSocket(const std::string& flag,
                                                     const std::string& path,
                                                     const SocketAccess& access, int type);

// Removes the socket file at `path` when it is still the one with `inode`.
void RemoveUnixSocket(const std::string& path, unsigned long inode);

class UnixSocketAcceptor {
 public:
  // Binds PATH and hands every connection to `server`, which must outlive the acceptor. The
  // socket is never looser than `access.mode`, whatever the umask, and has exactly that mode and
  // group before it listens. `flag` names the listener in errors. The caller removes a stale
  // socket first.
  static absl::StatusOr<std::unique_ptr<UnixSocketAcceptor>> Start(const std::string& flag,
                                                                   const std::string& path,
                                                                   grpc::Server* server,
                                                                   const SocketAccess& access);
  // Stops accepting and removes the socket file (when it is still the one bound here).
  ~UnixSocketAcceptor();

  UnixSocketAcceptor(const UnixSocketAcceptor&) = delete;
  UnixSocketAcceptor& operator=(const UnixSocketAcceptor&) = delete;

 private:
  UnixSocketAcceptor() = default;
  void Loop();

  std::string flag_;
  std::string path_;
  grpc::Server* server_ = nullptr;
  ListeningUnixSocket listening_;
  int wake_fd_ = -1;  // eventfd: written to stop the loop
  std::thread thread_;
};

// The kernel-verified uid of a call whose peer is "fd:N" on a Unix socket (a connection the
// acceptor handed over); nullopt for any other peer.
std::optional<uint32_t> UnixPeerUid(const std::string& peer);

// The pid of the process that connected, for such a call; nullopt for any other peer.
std::optional<int> UnixPeerPid(const std::string& peer);

// "uid:1000(alice)" for such a call; nullopt for any other peer.
std::optional<std::string> UnixPeerIdentity(const std::string& peer);

}  // namespace verifyd
