#pragma once
// Durable mode state and the append-only audit log in --state_dir:
//   state.json  the mode now, the build it was approved under and the gate's evidence (written
//               to a temp file, fsynced, renamed: never half-written)
//   audit.jsonl one JSON object per change, appended and fsynced
// The JSON text of both is parsed and produced by pure functions (state_json.cc), which tests
// and fuzz targets call directly.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/control/build_identity.h"
#include "src/control/mode.h"

namespace verifyd {

// What the flip gate has seen of the running build's custom path.
struct GateEvidence {
  int64_t clean = 0;        // comparisons in a row within tolerance and without error
  std::string last_breach;  // "TIME KIND: DETAIL" of the last one that was not
};

struct PersistedState {
  Mode mode = Mode::kShadow;
  double canary_fraction = 0.05;
  double shadow_sample_rate = 1.0;
  double custom_sample_rate = 0.01;
  bool custom_faulted = false;  // a sticky custom-path fault happened; never restore custom
  std::string custom_fault_reason;
  // The build that recorded this state: the flip to `mode` was approved, and `gate` gathered,
  // under it. Empty in a state file written before builds were recorded.
  BuildIdentity build;
  bool forced = false;  // canary/custom was entered by --force while the gate was closed
  GateEvidence gate;
};

// The admin API's rules, for a requested change and a loaded state alike: canary_fraction in
// (0, 1], sample rates in [0, 1], all finite; gate.clean >= 0. INVALID_ARGUMENT naming the field.
absl::Status ValidateState(const PersistedState& s);

// state.json's text to a state checked by ValidateState; an error names the field.
absl::StatusOr<PersistedState> ParseState(std::string_view json);
std::string SerializeState(const PersistedState& s);

// Who made a change. kDaemon is set only by the controller's own path (rollback, fault, restart
// under another build, start-up flags); nothing a client sends can produce it. kUnknown: a line
// written before origins were recorded.
enum class AuditOrigin { kUnknown, kClient, kDaemon };
const char* AuditOriginName(AuditOrigin o);  // "unknown", "client", "daemon"

// kDenied: a peer was refused another peer's region or channel (from == to == the mode; `peer`
// the refused caller, `reason` what it asked for and whose it is).
enum class AuditAction { kMode, kSampleRate, kDenied };
const char* AuditActionName(AuditAction a);  // "mode", "sample_rate", "denied"

struct AuditEntry {
  std::string time;  // RFC 3339 UTC
  Mode from = Mode::kShadow;
  Mode to = Mode::kShadow;
  double canary_fraction = 0;  // the fraction set by a change to canary; 0 for any other target
  std::string reason;
  bool forced = false;
  std::string who;  // the name the client sent, as sent; "verifyd" or "flag" for the daemon
  // Added fields; a line without them reads as a client-or-daemon ("unknown") mode change.
  AuditAction action = AuditAction::kMode;
  AuditOrigin origin = AuditOrigin::kUnknown;
  std::string peer;     // the identity the transport established (peer uid, token); may be empty
  BuildIdentity build;  // the build that made the change
  // action == kSampleRate: which mode's rate changed, from what to what (from == to == the mode).
  Mode sample_mode = Mode::kShadow;
  double sample_rate = 0;
  double previous_sample_rate = 0;
};

// One audit.jsonl line (without its newline) to an entry; a malformed line or a field of the
// wrong type is an error naming the field.
absl::StatusOr<AuditEntry> ParseAuditLine(std::string_view line);
std::string SerializeAuditEntry(const AuditEntry& e);  // one line, no newline

class StateStore {
 public:
  // Creates `dir` if needed.
  static absl::StatusOr<StateStore> Open(const std::string& dir);

  // The saved state, or nullopt when no state file exists. Any other failure (unreadable,
  // a directory, corrupt, out-of-range values) is an error naming the file and the field: a
  // restart must not silently change what is served.
  absl::StatusOr<std::optional<PersistedState>> Read() const;
  // Read(), with the defaults when no state was ever saved.
  absl::StatusOr<PersistedState> Load() const;
  absl::Status Save(const PersistedState& s) const;
  absl::Status AppendAudit(const AuditEntry& e) const;

  struct AuditLog {
    std::vector<AuditEntry> entries;  // the last `limit` well-formed entries, oldest first
    int64_t malformed_lines = 0;      // lines skipped because they do not parse
    std::string first_malformed;      // "line N: why" of the first one
  };
  // `each`, when given, sees every well-formed entry in order, also those before the last
  // `limit`.
  absl::StatusOr<AuditLog> ReadAuditLog(
      size_t limit, const std::function<void(const AuditEntry&)>& each = nullptr) const;
  // The last `limit` well-formed entries, oldest first.
  absl::StatusOr<std::vector<AuditEntry>> ReadAudit(size_t limit) const;

  const std::string& dir() const { return dir_; }
  std::string state_path() const { return dir_ + "/state.json"; }
  std::string audit_path() const { return dir_ + "/audit.jsonl"; }

 private:
  explicit StateStore(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace verifyd
