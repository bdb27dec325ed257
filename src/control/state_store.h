#pragma once
// Durable mode state and the append-only audit log in --state_dir:
//   state.json  the mode now (written to a temp file, fsynced, renamed: never half-written)
//   audit.jsonl one JSON object per change, appended and fsynced

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/control/mode.h"

namespace verifyd {

struct PersistedState {
  Mode mode = Mode::kShadow;
  double canary_fraction = 0.05;
  double shadow_sample_rate = 1.0;
  double custom_sample_rate = 0.01;
  bool custom_faulted = false;      // a sticky custom-path fault happened; never restore custom
  std::string custom_fault_reason;
};

struct AuditEntry {
  std::string time;  // RFC 3339 UTC
  Mode from = Mode::kShadow;
  Mode to = Mode::kShadow;
  double canary_fraction = 0;
  std::string reason;
  bool forced = false;
  std::string who;   // who the client says it is
  std::string peer;  // who the daemon verified (kernel uid on a Unix socket, token on TCP)
};

class StateStore {
 public:
  // Creates `dir` if needed.
  static absl::StatusOr<StateStore> Open(const std::string& dir);

  // Defaults when no state was ever saved; an unreadable state file is an error (a restart must
  // not silently change what is served).
  absl::StatusOr<PersistedState> Load() const;
  absl::Status Save(const PersistedState& s) const;
  absl::Status AppendAudit(const AuditEntry& e) const;
  // The last `limit` entries, oldest first.
  absl::StatusOr<std::vector<AuditEntry>> ReadAudit(size_t limit) const;

  const std::string& dir() const { return dir_; }

 private:
  explicit StateStore(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace verifyd
