#include "src/fleet/fleet_follower.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace verifyd::fleet {
namespace {

// The file's text (through any symlinks), or why it could not be read.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

std::string Dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string Describe(const NodeTarget& t) {
  return t.mode == Mode::kCanary ? absl::StrCat("canary ", t.canary_fraction) : ModeName(t.mode);
}

}  // namespace

FleetFollower::FleetFollower(FollowerOptions opts, Propose propose, Observe observe)
    : opts_(std::move(opts)), propose_(std::move(propose)), observe_(std::move(observe)) {}

FleetFollower::~FleetFollower() {
  if (stop_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof(one));
  }
  if (watcher_.joinable()) watcher_.join();
  if (inotify_fd_ >= 0) close(inotify_fd_);
  if (stop_fd_ >= 0) close(stop_fd_);
}

absl::Status FleetFollower::Start() {
  inotify_fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  stop_fd_ = eventfd(0, EFD_CLOEXEC);
  if (inotify_fd_ < 0 || stop_fd_ < 0) {
    return absl::InternalError(absl::StrCat("fleet_file: inotify: ", std::strerror(errno)));
  }
  AddWatch();
  LookNow();
  watcher_ = std::thread([this] { Watch(); });
  return absl::OkStatus();
}

bool FleetFollower::AddWatch() {
  if (watching_) return true;
  const std::string dir = Dir(opts_.path);
  watching_ = inotify_add_watch(inotify_fd_, dir.c_str(),
                                IN_CREATE | IN_MOVED_TO | IN_MOVED_FROM | IN_CLOSE_WRITE |
                                    IN_DELETE | IN_ATTRIB) >= 0;
  if (!watching_) {
    absl::MutexLock l(&mu_);
    watch_error_ = absl::StrCat("cannot watch the directory ", dir, ": ", std::strerror(errno),
                                " (looking again every poll)");
  }
  return watching_;
}

void FleetFollower::Watch() {
  const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(opts_.poll));
  for (;;) {
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {inotify_fd_, POLLIN, 0}};
    const int n = poll(fds, 2, timeout_ms > 0 ? timeout_ms : 1000);
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) return;
    if (fds[1].revents != 0) {
      char events[4096];
      while (read(inotify_fd_, events, sizeof(events)) > 0) {
      }
    }
    AddWatch();  // a directory that did not exist at start may now
    LookNow();
  }
}

void FleetFollower::LookNow() {
  absl::StatusOr<std::string> text = ReadFile(opts_.path);
  if (!text.ok() && !watching_) {
    absl::MutexLock l(&mu_);
    text = absl::Status(text.status().code(),
                        absl::StrCat(text.status().message(), "; ", watch_error_));
  }
  Consider(std::move(text));
}

void FleetFollower::Consider(absl::StatusOr<std::string> text) {
  absl::MutexLock one(&look_mu_);
  absl::StatusOr<DesiredState> state =
      text.ok() ? ParseDesiredState(*text) : absl::StatusOr<DesiredState>(text.status());
  FollowerStatus now;
  {
    absl::MutexLock l(&mu_);
    if (!state.ok()) {
      const std::string error(state.status().message());
      if (status_.source_up || status_.source_error != error) {
        spdlog::warn("fleet: {} (keeping mode; generation {} stays acted on)", error,
                     status_.generation_acted);
      }
      status_.source_up = false;
      status_.source_error = error;
      now = status_;
    } else {
      status_.source_up = true;
      status_.source_error.clear();
      status_.generation_seen = std::max(status_.generation_seen, state->generation);
      now = status_;
    }
  }
  bool acted = false;
  if (state.ok() && state->generation > now.generation_acted) {
    acted = true;
    // The source's state is told before the node changes mode on it: whoever sees the new mode
    // sees the source that asked for it as up.
    if (observe_) observe_(now, false);
    const NodeTarget target = TargetFor(*state, opts_.node);
    const bool in_step = InStep(*state, opts_.node);
    std::string outcome, detail;
    if (!state->build.empty() && state->build != opts_.build) {
      outcome = "other_build";
      detail = absl::StrCat("generation ", state->generation, " is for build ", state->build,
                            "; this node runs ", opts_.build);
    } else {
      const std::string reason = absl::StrCat("fleet generation ", state->generation,
                                              in_step ? " (in its step)" : " (stable)",
                                              state->reason.empty() ? "" : ": ", state->reason);
      const absl::Status st = propose_(target, reason);
      outcome = st.ok() ? "applied" : "refused";
      detail =
          st.ok() ? Describe(target) : absl::StrCat(Describe(target), " refused: ", st.message());
    }
    if (outcome == "applied") {
      spdlog::info("fleet: generation {}: {}", state->generation, detail);
    } else {
      spdlog::warn("fleet: generation {}: {}", state->generation, detail);
    }
    absl::MutexLock l(&mu_);
    status_.generation_acted = state->generation;
    status_.in_step = in_step;
    status_.last_outcome = outcome;
    status_.last_detail = detail;
    now = status_;
  }
  if (observe_) observe_(now, acted);
}

FollowerStatus FleetFollower::status() const {
  absl::MutexLock l(&mu_);
  return status_;
}

}  // namespace verifyd::fleet
