#include "src/control/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

constexpr size_t kMaxStateBytes = 1 << 20;  // state.json is a few hundred bytes

absl::Status Errno(const std::string& what) { return absl::ErrnoToStatus(errno, what); }

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write " + path);
    }
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// The whole file, or an error naming it and the system's reason (EACCES, EISDIR, ...).
absl::StatusOr<std::string> ReadSmallFile(int fd, const std::string& path) {
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno(path + " cannot be read");
    }
    if (n == 0) return text;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxStateBytes) {
      return absl::DataLossError(absl::StrCat(path, " is larger than ", kMaxStateBytes, " bytes"));
    }
  }
}

}  // namespace

absl::StatusOr<StateStore> StateStore::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("state_dir ", dir, ": ", ec.message()));
  if (::access(dir.c_str(), W_OK) != 0) return Errno("state_dir " + dir + " is not writable");
  return StateStore(dir);
}

absl::StatusOr<std::optional<PersistedState>> StateStore::Read() const {
  const std::string path = state_path();
  const char* const fix = "; fix or remove it to start in shadow";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    absl::Status st = Errno(path + " cannot be opened");
    return absl::Status(st.code(), absl::StrCat(st.message(), fix));
  }
  absl::StatusOr<std::string> text = ReadSmallFile(fd, path);
  ::close(fd);
  if (!text.ok())
    return absl::Status(text.status().code(), absl::StrCat(text.status().message(), fix));
  absl::StatusOr<PersistedState> s = ParseState(*text);
  if (!s.ok()) {
    return absl::DataLossError(absl::StrCat(path, " is unreadable: ", s.status().message(), fix));
  }
  return std::optional<PersistedState>(*std::move(s));
}

absl::StatusOr<PersistedState> StateStore::Load() const {
  absl::StatusOr<std::optional<PersistedState>> s = Read();
  if (!s.ok()) return s.status();
  return s->value_or(PersistedState{});
}

absl::Status StateStore::Save(const PersistedState& s) const {
  const std::string path = state_path();
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open " + tmp);
  absl::Status st = WriteAll(fd, SerializeState(s), tmp);
  if (st.ok() && ::fsync(fd) != 0) st = Errno("fsync " + tmp);
  ::close(fd);
  if (!st.ok()) return st;
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Errno("rename " + tmp);
  int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::Status StateStore::AppendAudit(const AuditEntry& e) const {
  const std::string path = audit_path();
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open " + path);
  std::string line = SerializeAuditEntry(e) + "\n";
  // A crash mid-append leaves a torn last line; start on a line of our own.
  struct stat st_buf;
  char last = '\n';
  if (::fstat(fd, &st_buf) == 0 && st_buf.st_size > 0 &&
      ::pread(fd, &last, 1, st_buf.st_size - 1) == 1 && last != '\n') {
    line.insert(line.begin(), '\n');
  }
  absl::Status st = WriteAll(fd, line, path);
  if (st.ok() && ::fsync(fd) != 0) st = Errno("fsync " + path);
  ::close(fd);
  return st;
}

absl::StatusOr<StateStore::AuditLog> StateStore::ReadAuditLog(
    size_t limit, const std::function<void(const AuditEntry&)>& each) const {
  const std::string path = audit_path();
  AuditLog log;
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT || !std::filesystem::exists(path)) return log;
    return Errno(path + " cannot be read");
  }
  std::deque<AuditEntry> last;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    absl::StatusOr<AuditEntry> e = ParseAuditLine(line);
    if (!e.ok()) {
      if (log.malformed_lines++ == 0) {
        log.first_malformed = absl::StrCat("line ", line_no, ": ", e.status().message());
      }
      continue;
    }
    if (each) each(*e);
    last.push_back(*std::move(e));
    if (last.size() > limit) last.pop_front();
  }
  if (in.bad()) return Errno(path + " cannot be read");
  log.entries.assign(std::make_move_iterator(last.begin()), std::make_move_iterator(last.end()));
  return log;
}

absl::StatusOr<std::vector<AuditEntry>> StateStore::ReadAudit(size_t limit) const {
  absl::StatusOr<AuditLog> log = ReadAuditLog(limit);
  if (!log.ok()) return log.status();
  return std::move(log->entries);
}

}  // namespace verifyd
