#pragma once
// Another process on verifyd's Unix socket, as the kernel sees it: a child connects the socket
// the test created (SO_PEERCRED records the child's pid, and its uid when it switched to another
// one first) and waits; the test speaks gRPC over the socket. Killing the child is what verifyd
// sees when a client dies.

#include <grp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "grpcpp/create_channel_posix.h"
#include "gtest/gtest.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd::testing {

class PeerProcess {
 public:
  // Connects `target` ("unix:PATH") from a child process; with `uid`, the child becomes that
  // user (uid and gid, no groups) first, which needs root. Null (and a test failure) when the
  // child cannot connect.
  static std::unique_ptr<PeerProcess> Connect(const std::string& target,
                                              std::optional<uid_t> uid = std::nullopt) {
    const std::string path = target.substr(target.find(':') + 1);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int ready[2];
    if (fd < 0 || ::pipe2(ready, O_CLOEXEC) != 0) {
      ADD_FAILURE() << std::strerror(errno);
      return nullptr;
    }
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    const pid_t child = ::fork();
    if (child == 0) {  // async-signal-safe calls only
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      bool ok = true;
      if (uid) {
        ok = ::setgroups(0, nullptr) == 0 && ::setresgid(*uid, *uid, *uid) == 0 &&
             ::setresuid(*uid, *uid, *uid) == 0;
      }
      ok = ok && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
      const char c = ok ? 'k' : 'e';
      (void)!::write(ready[1], &c, 1);
      if (!ok) ::_exit(1);
      for (;;) ::pause();
    }
    ::close(ready[1]);
    char c = 0;
    const bool ok = ::read(ready[0], &c, 1) == 1 && c == 'k';
    ::close(ready[0]);
    auto p = std::unique_ptr<PeerProcess>(new PeerProcess(child));
    if (!ok) {
      ::close(fd);
      ADD_FAILURE() << "the child could not "
                    << (uid ? "become uid " + std::to_string(*uid) + " or " : "") << "connect "
                    << path;
      return nullptr;
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(INT32_MAX);
    args.SetMaxSendMessageSize(INT32_MAX);
    p->stub_ =
        v1::VerifyService::NewStub(grpc::CreateCustomInsecureChannelFromFd(target, fd, args));
    return p;
  }
  ~PeerProcess() { Kill(); }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  v1::VerifyService::Stub* stub() const { return stub_.get(); }
  pid_t pid() const { return pid_; }
  // Ends the child with SIGKILL and reaps it; the connection stays open in the test.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  explicit PeerProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  std::unique_ptr<v1::VerifyService::Stub> stub_;
};

}  // namespace verifyd::testing
