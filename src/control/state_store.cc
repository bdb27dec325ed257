#include "src/control/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace verifyd {
namespace {

using nlohmann::json;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

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

Mode ModeOr(const json& j, const char* key, Mode def) {
  if (!j.contains(key)) return def;
  return ParseMode(j.at(key).get<std::string>()).value_or(def);
}

}  // namespace

absl::StatusOr<StateStore> StateStore::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("state_dir ", dir, ": ", ec.message()));
  if (::access(dir.c_str(), W_OK) != 0) return Errno("state_dir " + dir + " is not writable");
  return StateStore(dir);
}

absl::StatusOr<PersistedState> StateStore::Load() const {
  const std::string path = dir_ + "/state.json";
  PersistedState s;
  std::ifstream in(path);
  if (!in) return s;
  try {
    json j = json::parse(in);
    const auto mode = ParseMode(j.at("mode").get<std::string>());
    if (!mode) return absl::DataLossError(absl::StrCat(path, ": unknown mode ", j.at("mode").dump()));
    s.mode = *mode;
    s.canary_fraction = j.value("canary_fraction", s.canary_fraction);
    s.shadow_sample_rate = j.value("shadow_sample_rate", s.shadow_sample_rate);
    s.custom_sample_rate = j.value("custom_sample_rate", s.custom_sample_rate);
    s.custom_faulted = j.value("custom_faulted", false);
    s.custom_fault_reason = j.value("custom_fault_reason", std::string());
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, " is unreadable (", e.what(),
                                            "); fix or remove it to start in shadow"));
  }
  return s;
}

absl::Status StateStore::Save(const PersistedState& s) const {
  json j = {{"mode", ModeName(s.mode)},
            {"canary_fraction", s.canary_fraction},
            {"shadow_sample_rate", s.shadow_sample_rate},
            {"custom_sample_rate", s.custom_sample_rate},
            {"custom_faulted", s.custom_faulted},
            {"custom_fault_reason", s.custom_fault_reason}};
  const std::string path = dir_ + "/state.json";
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open " + tmp);
  absl::Status st = WriteAll(fd, j.dump(2) + "\n", tmp);
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
  json j = {{"time", e.time},     {"from", ModeName(e.from)},
            {"to", ModeName(e.to)}, {"canary_fraction", e.canary_fraction},
            {"reason", e.reason}, {"forced", e.forced},
            {"who", e.who}, {"peer", e.peer}};
  const std::string path = dir_ + "/audit.jsonl";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("open " + path);
  absl::Status st = WriteAll(fd, j.dump() + "\n", path);
  if (st.ok() && ::fsync(fd) != 0) st = Errno("fsync " + path);
  ::close(fd);
  return st;
}

absl::StatusOr<std::vector<AuditEntry>> StateStore::ReadAudit(size_t limit) const {
  std::ifstream in(dir_ + "/audit.jsonl");
  std::deque<AuditEntry> last;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) continue;  // a torn last line from a crash mid-append
    AuditEntry e;
    e.time = j.value("time", "");
    e.from = ModeOr(j, "from", Mode::kShadow);
    e.to = ModeOr(j, "to", Mode::kShadow);
    e.canary_fraction = j.value("canary_fraction", 0.0);
    e.reason = j.value("reason", "");
    e.forced = j.value("forced", false);
    e.who = j.value("who", "");
    e.peer = j.value("peer", "");
    last.push_back(std::move(e));
    if (last.size() > limit) last.pop_front();
  }
  return std::vector<AuditEntry>(last.begin(), last.end());
}

}  // namespace verifyd
