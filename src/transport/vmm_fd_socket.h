#pragma once
// The descriptor socket: a SOCK_SEQPACKET Unix socket next to the data socket (its path +
// ".fds", with the data socket's mode and group) on which clients pass the file descriptors of
// CUDA VMM chunks (SCM_RIGHTS), which gRPC cannot carry. Each message is parsed
// (vmm_fd_payload.h) and its descriptors are deposited in the inbox with the sender's uid and pid
// (SO_PEERCRED); each gets one answer packet, "ok" or the error naming the field. A connection
// that sends nothing for a second is dropped. Sets left untaken are closed as the inbox's ttl
// says, checked every second.

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "src/transport/unix_socket_acceptor.h"
#include "src/transport/vmm_fd_inbox.h"

namespace verifyd {

class VmmFdSocket {
 public:
  // The descriptor socket's path for a data socket at `data_socket_path`.
  static std::string PathFor(const std::string& data_socket_path) {
    return data_socket_path + ".fds";
  }
  // Whether `path` fits in a Unix socket address (107 bytes). A data socket path near that
  // length leaves no room for ".fds": verifyd then serves without a descriptor socket.
  static bool PathFits(const std::string& path);
  // Binds `path` and serves it into `inbox`, which must outlive the socket. `flag` names the
  // listener in errors. The caller removes a stale socket first.
  static absl::StatusOr<std::unique_ptr<VmmFdSocket>> Start(const std::string& flag,
                                                            const std::string& path,
                                                            const SocketAccess& access,
                                                            VmmFdInbox* inbox);
  // Stops serving and removes the socket file (when it is still the one bound here).
  ~VmmFdSocket();
  VmmFdSocket(const VmmFdSocket&) = delete;
  VmmFdSocket& operator=(const VmmFdSocket&) = delete;

 private:
  VmmFdSocket() = default;
  void Loop();
  void Serve(int conn);

  std::string flag_;
  std::string path_;
  VmmFdInbox* inbox_ = nullptr;
  ListeningUnixSocket listening_;
  UniqueFd wake_;  // eventfd: written to stop the loop
  std::thread thread_;
};

}  // namespace verifyd
