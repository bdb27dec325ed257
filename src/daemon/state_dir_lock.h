#pragma once
// One verifyd per state dir: an exclusive flock on STATE_DIR/verifyd.lock, held for the life of
// the process (the kernel drops it when the process dies, even on kill -9). The file holds the
// holder's pid so that a refused start can name it.

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace verifyd {

class StateDirLock {
 public:
  // Creates `dir` if needed and takes the lock, or says which pid holds it.
  static absl::StatusOr<std::unique_ptr<StateDirLock>> Acquire(const std::string& dir);
  ~StateDirLock();
  StateDirLock(const StateDirLock&) = delete;
  StateDirLock& operator=(const StateDirLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  StateDirLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

}  // namespace verifyd
