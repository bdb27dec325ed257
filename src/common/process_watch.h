#pragma once
// Watches a process for its exit through a pidfd: the descriptor refers to that process, so a pid
// reused after the process exited is never mistaken for it.

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace verifyd {

class ProcessWatch {
 public:
  ProcessWatch() = default;
  // Watches `pid`; watches nothing when the kernel has no pidfds (before Linux 5.3) or the
  // process is gone already (then gone() is true at once).
  explicit ProcessWatch(int pid) : pid_(pid) {
#ifdef SYS_pidfd_open
    fd_ = pid > 0 ? static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)) : -1;
#endif
    gone_at_start_ = fd_ < 0 && pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
  }
  ProcessWatch(ProcessWatch&& o) noexcept
      : pid_(o.pid_), fd_(std::exchange(o.fd_, -1)), gone_at_start_(o.gone_at_start_) {}
  ProcessWatch& operator=(ProcessWatch&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      pid_ = o.pid_;
      fd_ = std::exchange(o.fd_, -1);
      gone_at_start_ = o.gone_at_start_;
    }
    return *this;
  }
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;
  ~ProcessWatch() {
    if (fd_ >= 0) ::close(fd_);
  }

  int pid() const { return pid_; }
  bool watching() const { return fd_ >= 0; }
  // True once the process exited (or was gone before it was watched). Never blocks.
  bool gone() const {
    if (gone_at_start_) return true;
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

 private:
  int pid_ = 0;
  int fd_ = -1;
  bool gone_at_start_ = false;
};

}  // namespace verifyd
