#include "src/transport/vmm_fd_socket.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace verifyd {
namespace {

constexpr int kReceiveTimeoutMs = 1000;

// Lets the process hold as many descriptors as its hard limit allows: a large allocation arrives
// as thousands of chunk descriptors.
void RaiseDescriptorLimit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= r.rlim_max) return;
  const rlim_t was = r.rlim_cur;
  r.rlim_cur = r.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &r) == 0) {
    spdlog::info("descriptor socket: open file limit raised from {} to {}", was, r.rlim_max);
  }
}

void Answer(int conn, const std::string& text) {
  if (::send(conn, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    spdlog::debug("descriptor socket: answer not sent: {}", std::strerror(errno));
  }
}

}  // namespace

bool VmmFdSocket::PathFits(const std::string& path) {
  return !path.empty() && path.size() < sizeof(sockaddr_un{}.sun_path);
}

absl::StatusOr<std::unique_ptr<VmmFdSocket>> VmmFdSocket::Start(const std::string& flag,
                                                                const std::string& path,
                                                                const SocketAccess& access,
                                                                VmmFdInbox* inbox) {
  std::unique_ptr<VmmFdSocket> s(new VmmFdSocket);
  s->flag_ = flag;
  s->path_ = path;
  s->inbox_ = inbox;
  absl::StatusOr<ListeningUnixSocket> l = ListenUnixSocket(flag, path, access, SOCK_SEQPACKET);
  if (!l.ok()) return l.status();
  s->listening_ = std::move(*l);
  s->wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC));
  if (!s->wake_.valid()) {
    return absl::UnavailableError(absl::StrCat(flag, ": eventfd: ", std::strerror(errno)));
  }
  RaiseDescriptorLimit();
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

VmmFdSocket::~VmmFdSocket() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) != sizeof one) {
      spdlog::error("{}: cannot stop the descriptor socket: {}", flag_, std::strerror(errno));
    }
    thread_.join();
  }
  listening_.fd.Reset();
  RemoveUnixSocket(path_, listening_.inode);
}

void VmmFdSocket::Loop() {
  for (;;) {
    pollfd fds[2] = {{listening_.fd.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    const int n = ::poll(fds, 2, kReceiveTimeoutMs);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("{}: poll: {}", flag_, std::strerror(errno));
      return;
    }
    inbox_->Expire();
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd conn(::accept4(listening_.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("{}: accept: {}", flag_, std::strerror(errno));
      }
      continue;
    }
    Serve(conn.get());
  }
}

void VmmFdSocket::Serve(int conn) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  timeval tv{kReceiveTimeoutMs / 1000, (kReceiveTimeoutMs % 1000) * 1000};
  ::setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (;;) {
    // One byte more than a payload, to tell a longer message from one of the right size.
    char payload[kVmmFdPayloadBytes + 1];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kVmmFdsPerMessage)];
    iovec iov{payload, sizeof payload};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t got = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (got <= 0) return;  // closed, timed out or failed: the connection ends
    std::vector<UniqueFd> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.emplace_back(fd);
      }
    }
    absl::Status st;
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      st = absl::InvalidArgumentError(
          absl::StrCat("fds: descriptors were dropped (more than ", kVmmFdsPerMessage,
                       " in one message, or more than verifyd may open); send at most ",
                       kVmmFdsPerMessage, " a message"));
    } else if ((msg.msg_flags & MSG_TRUNC) != 0) {
      st = absl::InvalidArgumentError(
          absl::StrCat("payload: longer than ", kVmmFdPayloadBytes, " bytes"));
    } else {
      absl::StatusOr<VmmFdMessage> m =
          ParseVmmFdPayload(absl::string_view(payload, static_cast<size_t>(got)), fds.size(),
                            inbox_->limits().max_fds_per_token);
      st = m.ok() ? inbox_->Deposit(*m, std::move(fds), cred.uid, cred.pid) : m.status();
    }
    if (!st.ok()) {
      spdlog::info("{}: refused a message from uid {} pid {}: {}", flag_, cred.uid, cred.pid,
                   std::string(st.message()));
    }
    Answer(conn, st.ok() ? std::string("ok") : std::string(st.message()));
  }
}

}  // namespace verifyd
