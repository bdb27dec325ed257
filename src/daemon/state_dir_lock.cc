#include "src/daemon/state_dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace verifyd {

absl::StatusOr<std::unique_ptr<StateDirLock>> StateDirLock::Acquire(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("state_dir ", dir, ": ", ec.message()));
  const std::string path = dir + "/verifyd.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("state_dir: cannot open ", path, ": ", std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    if (e != EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("state_dir: cannot lock ", path, ": ", std::strerror(e)));
    }
    const std::string pid(absl::StripAsciiWhitespace(std::string(buf, n > 0 ? n : 0)));
    return absl::AlreadyExistsError(absl::StrCat("state_dir ", dir, " is locked by ",
                                                 pid.empty() ? "another process" : "pid " + pid,
                                                 " (another verifyd uses it)"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int e = errno;
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("state_dir: cannot write ", path, ": ", std::strerror(e)));
  }
  return std::unique_ptr<StateDirLock>(new StateDirLock(path, fd));
}

StateDirLock::~StateDirLock() { ::close(fd_); }

}  // namespace verifyd
