#pragma once
// Writes compared bundles to --capture_dir as .safetensors (the golden files' layout plus both
// outputs, the oracle's when sampled, a shadow tap's stack output, and the comparison in the
// metadata): every breach
// (rate-limited) and, on request, the next N compared calls. A byte and file quota holds (oldest
// deleted first) and a minimum of free disk is always left.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "src/compare/compare.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"

namespace verifyd {

struct CaptureOptions {
  std::string dir;                       // empty: capture off
  int64_t max_bytes = int64_t{4} << 30;  // all capture files together
  int64_t max_files = 200;
  int64_t min_free_bytes = int64_t{1} << 30;  // never fill the disk past this
  double min_breach_interval_seconds = 10;    // rate limit of breach captures
};

// One comparison, as captured.
struct ComparisonRecord {
  std::shared_ptr<const OwnedBundle> bundle;
  Plan plan;
  Outcome outcome;
  Tolerance tolerance;
  PathOutput reference, custom, oracle;
  bool has_oracle = false;
  std::string request_id;
  // A shadow tap's comparison: the serving stack's own output (bf16, o's shape) and its backend,
  // written as o_stack and metadata stack_backend; empty otherwise.
  std::vector<uint16_t> stack_o;
  std::string stack_backend;
};

struct CaptureStatus {
  std::string dir;
  int64_t files = 0, bytes = 0, pending = 0, written = 0, dropped = 0;
};

class Capturer {
 public:
  // Creates the directory and takes stock of the files already there; removes the temporary
  // files of writes cut short (a crash or kill -9 mid-write).
  static absl::StatusOr<std::unique_ptr<Capturer>> Create(const CaptureOptions& opts,
                                                          std::string build_info);

  // Whether to capture this comparison (and take a "next N" slot or the breach token).
  // Returns the trigger ("requested" or "breach") or "" for no.
  std::string Claim(bool breach);
  // Writes the record atomically and enforces the quota (counting the files being written).
  // Returns the file written. A "requested" capture that is not written gives its slot back.
  absl::StatusOr<std::string> Write(const ComparisonRecord& r, const std::string& trigger);
  void RequestNext(int64_t n);
  CaptureStatus Status() const;

 private:
  Capturer(CaptureOptions opts, std::string build_info);
  void EnforceQuotaLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a capture that was not written and returns `why`.
  absl::Status Dropped(const std::string& trigger, absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DroppedLocked(const std::string& trigger, absl::Status why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CaptureOptions opts_;
  const std::string build_info_;
  mutable absl::Mutex mu_;
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  double last_breach_capture_ ABSL_GUARDED_BY(mu_) = -1e300;
  int64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  struct File {
    std::string path;
    int64_t bytes;
  };
  std::deque<File> files_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t writing_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // estimates of the writes in progress
  int64_t writing_files_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace verifyd
