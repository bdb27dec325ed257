#pragma once
// A test client of the descriptor socket (src/transport/vmm_fd_socket.h), and descriptors to send.

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/unique_fd.h"

namespace verifyd {

// n open descriptors (the read ends of pipes).
inline std::vector<UniqueFd> PipeFds(int n) {
  std::vector<UniqueFd> out;
  for (int i = 0; i < n; ++i) {
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
    ::close(p[1]);
    out.emplace_back(p[0]);
  }
  return out;
}

// A client of the socket: connects, sends messages with descriptors, reads the answers.
class FdClient {
 public:
  explicit FdClient(const std::string& path) {
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    connected_ = ::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  bool connected() const { return connected_; }
  // Sends `payload` with `fds` and returns verifyd's answer.
  std::string Send(const std::string& payload, const std::vector<UniqueFd>& fds) {
    iovec iov{const_cast<char*>(payload.data()), payload.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      for (size_t i = 0; i < fds.size(); ++i) {
        const int fd = fds[i].get();
        std::memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof fd);
      }
    }
    if (::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL) < 0)
      return std::string("send failed: ") + std::strerror(errno);
    char answer[512];
    const ssize_t n = ::recv(fd_.get(), answer, sizeof answer, 0);
    return n <= 0 ? std::string("(no answer)") : std::string(answer, static_cast<size_t>(n));
  }

 private:
  UniqueFd fd_;
  bool connected_ = false;
};

}  // namespace verifyd
