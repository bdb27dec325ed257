#pragma once
// The descriptors clients sent on the descriptor socket (vmm_fd_socket.h), held under their
// tokens until a RegisterCudaVmmRegion call takes them. Each token's set remembers the uid and
// pid of the process that sent it (SO_PEERCRED), and only a call from that uid takes it. A set
// not taken within the limits' ttl is closed, and so is one whose message was refused; the count
// of tokens and of descriptors held is bounded.

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/unique_fd.h"
#include "src/transport/vmm_fd_payload.h"

namespace verifyd {

struct VmmFdLimits {
  int64_t max_tokens = 64;                 // sets held at once
  int64_t max_fds = 8192;                  // descriptors held at once, all tokens
  uint32_t max_fds_per_token = 8192;       // a 160 GB allocation in 20 MB chunks
  absl::Duration ttl = absl::Seconds(60);  // from a token's first message to its close
};

class VmmFdInbox {
 public:
  explicit VmmFdInbox(VmmFdLimits limits, std::function<absl::Time()> clock = &absl::Now);
  const VmmFdLimits& limits() const { return limits_; }

  // Adds one message's descriptors to its token's set; they are closed when it is refused.
  // INVALID_ARGUMENT naming `first` or `total` for a message out of order or that disagrees
  // with the earlier ones, PERMISSION_DENIED naming `token` for a token another uid holds,
  // RESOURCE_EXHAUSTED naming `token` or `fds` past the limits.
  absl::Status Deposit(const VmmFdMessage& m, std::vector<UniqueFd> fds, uint32_t uid, int pid);
  // The complete set held under `token`, which leaves the inbox. NOT_FOUND naming `token` when
  // none is held (never sent, already taken, or expired), PERMISSION_DENIED when another uid sent
  // it (the set stays for its owner), FAILED_PRECONDITION while some of it has not arrived.
  absl::StatusOr<std::vector<UniqueFd>> Take(const std::string& token, uint32_t uid);
  // Closes the sets past their ttl.
  void Expire();

  int64_t tokens() const;
  int64_t fds() const;

 private:
  struct Held {
    uint32_t uid = 0;
    int pid = 0;
    uint32_t total = 0;
    absl::Time expires;
    std::vector<UniqueFd> fds;
  };
  void ExpireLocked(absl::Time now);

  const VmmFdLimits limits_;
  const std::function<absl::Time()> clock_;
  mutable std::mutex mu_;
  std::map<std::string, Held> held_;  // guarded by mu_
  int64_t fds_ = 0;                   // guarded by mu_
};

}  // namespace verifyd
