#include "src/transport/vmm_fd_inbox.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace verifyd {

VmmFdInbox::VmmFdInbox(VmmFdLimits limits, std::function<absl::Time()> clock)
    : limits_(limits), clock_(std::move(clock)) {}

void VmmFdInbox::ExpireLocked(absl::Time now) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    spdlog::info("descriptor socket: {} descriptors from uid {} pid {} expired untaken",
                 it->second.fds.size(), it->second.uid, it->second.pid);
    fds_ -= static_cast<int64_t>(it->second.fds.size());
    it = held_.erase(it);
  }
}

void VmmFdInbox::Expire() {
  std::lock_guard<std::mutex> l(mu_);
  ExpireLocked(clock_());
}

absl::Status VmmFdInbox::Deposit(const VmmFdMessage& m, std::vector<UniqueFd> fds, uint32_t uid,
                                 int pid) {
  const absl::Time now = clock_();
  std::lock_guard<std::mutex> l(mu_);
  ExpireLocked(now);
  const auto n = static_cast<int64_t>(fds.size());
  auto it = held_.find(m.token);
  if (it == held_.end()) {
    if (m.first != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("first: ", m.first,
                       " for a token verifyd holds nothing under (the first message of a "
                       "token starts at 0; an earlier one may have expired)"));
    }
    if (static_cast<int64_t>(held_.size()) >= limits_.max_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "token: ", held_.size(), " tokens hold descriptors, the most verifyd keeps (",
          "each is closed ", absl::FormatDuration(limits_.ttl),
          " after it arrives unless a RegisterCudaVmmRegion call takes it)"));
    }
  } else {
    Held& h = it->second;
    if (h.uid != uid) {
      return absl::PermissionDeniedError(
          absl::StrCat("token: another uid holds descriptors under this token (uid ", uid,
                       " sent this message); choose 16 random bytes"));
    }
    if (h.total != m.total) {
      return absl::InvalidArgumentError(
          absl::StrCat("total: ", m.total, ", but the token's first message said ", h.total));
    }
    if (m.first != h.fds.size()) {
      return absl::InvalidArgumentError(absl::StrCat("first: ", m.first, ", expected ",
                                                     h.fds.size(),
                                                     " (send a token's descriptors in order)"));
    }
  }
  if (fds_ + n > limits_.max_fds) {
    return absl::ResourceExhaustedError(
        absl::StrCat("fds: ", fds_, " descriptors are held and this message adds ", n,
                     ", more than verifyd keeps (", limits_.max_fds, ")"));
  }
  if (it == held_.end()) {
    Held h;
    h.uid = uid;
    h.pid = pid;
    h.total = m.total;
    h.expires = now + limits_.ttl;
    it = held_.emplace(m.token, std::move(h)).first;
  }
  for (UniqueFd& fd : fds) it->second.fds.push_back(std::move(fd));
  fds_ += n;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<UniqueFd>> VmmFdInbox::Take(const std::string& token, uint32_t uid) {
  std::lock_guard<std::mutex> l(mu_);
  ExpireLocked(clock_());
  auto it = held_.find(token);
  if (it == held_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "token: verifyd holds no descriptors under this token (never sent on the descriptor "
        "socket, already taken, or closed ",
        absl::FormatDuration(limits_.ttl), " after they arrived)"));
  }
  Held& h = it->second;
  if (h.uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "token: its descriptors were sent by another uid than this call's (uid ", uid, ")"));
  }
  if (h.fds.size() != h.total) {
    return absl::FailedPreconditionError(
        absl::StrCat("token: ", h.fds.size(), " of its ", h.total, " descriptors have arrived"));
  }
  std::vector<UniqueFd> out = std::move(h.fds);
  fds_ -= static_cast<int64_t>(out.size());
  held_.erase(it);
  return out;
}

int64_t VmmFdInbox::tokens() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(held_.size());
}

int64_t VmmFdInbox::fds() const {
  std::lock_guard<std::mutex> l(mu_);
  return fds_;
}

}  // namespace verifyd
