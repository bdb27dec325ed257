#pragma once
// One Verify call from decoded request to response, shared by the unary RPC and the stream:
// decode and validate, plan by mode, run the served path, hand the other path and the
// comparison to the shadow runner (or run them first when asked), record the outcome.

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "src/bundle/request_codec.h"
#include "src/bundle/request_in_place.h"
#include "src/capture/capturer.h"
#include "src/channel/channel_server.h"
#include "src/compare/compare.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/metrics/metrics.h"
#include "src/server/shadow_runner.h"
#include "verifyd/v1/admin.pb.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

struct HandlerOptions {
  Tolerance tolerance;
  double oracle_sample_rate = 0.001;  // fraction of comparisons that also run the oracle
  // A custom path slower than this is a timeout outcome (in every mode: in custom and canary the
  // served custom path's own time counts); 0 = none.
  double custom_timeout_seconds = 0;
  uint64_t seed = 0x0c1e;  // oracle sampling draws
  // Most work one call may ask for, in query rows x KV tokens (sum over requests of
  // draft * heads * kv_len; one unit is one query row of one head against one KV token, about
  // 2 * (576 + 512) FLOPs per path). Larger calls are refused with RESOURCE_EXHAUSTED. 0 = none.
  int64_t max_call_work = int64_t{1} << 34;
};

class VerifyHandler {
 public:
  VerifyHandler(Engine* engine, ModeController* controller, Metrics* metrics, ShadowRunner* shadow,
                HandlerOptions opts);

  // The registered regions requests may name; null: none.
  void SetRegions(const RegionRegistry* r) { regions_ = r; }
  // Captures breaching (and requested) comparisons; null turns capture off.
  void SetCapturer(Capturer* c) { capturer_ = c; }
  // `call`: the client's deadline and cancellation, and who it is (the regions it may name;
  // RegionRegistry::Resolve). An abandoned call stops before its next path
  // (and, on the CPU engine, within it) and returns CANCELLED or DEADLINE_EXCEEDED.
  // `in_place`: where q's and kv_pool's inline bytes are when `req` does not hold them
  // (ParseRequestInPlace); they must stay there until Handle returns.
  // `layout_key`: names the call's layout for reuse (BundleView::layout_key), 0 for none.
  absl::Status Handle(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                      const CallContext& call = CallContext(),
                      const InPlaceTensors* in_place = nullptr, uint64_t layout_key = 0);
  // Zero-fills the ranges `req` names in o_out and lse_out, regions `caller` may use (a doorbell
  // call that failed: its client reads them without an answer). Failures are logged.
  void ZeroOutputs(const v1::VerifyRequest& req, const Peer& caller);
  // A shadow tap's fill (verify_handler_tap.cc): runs the reference and the custom path on the
  // slot's call, whose o_out holds the serving stack's own output, and compares the three pairs.
  // The custom-vs-reference outcome feeds the gate and the rollback window as any comparison.
  // `owner`: the peer that opened the tap, whose regions the call names.
  TapResult ServeTap(const v1::VerifyRequest& call, const std::string& backend, const Peer& owner);
  // Writes `bytes` bytes from `src` at `offset` of region `region`, which `owner` may use (a
  // shadow tap's control words).
  absl::Status WriteRegion(const Peer& owner, RegionKind kind, const std::string& region,
                           uint64_t offset, const void* src, uint64_t bytes);
  double TapSampleRate() const { return controller_->shadow_sample_rate(); }
  // The mode, and its canary fraction (in-process switches follow both).
  std::pair<Mode, double> ServingMode() const { return controller_->serving_mode(); }
  const HandlerOptions& options() const { return opts_; }
  // Totals since start, for the admin status.
  v1::Counters counters() const;

 private:
  absl::Status Serve(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                     const CallContext& call, const InPlaceTensors* in_place, uint64_t layout_key);
  // RESOURCE_EXHAUSTED naming --max_call_work when the request asks for more.
  absl::Status CheckWork(const BundleView& v) const;
  // For a call whose comparison runs off the critical path: its place in the shadow queue, taken
  // before the served path runs. Without one, a canary call planned for custom is served by the
  // reference instead (every canary call is checked; counted as shed); any other call goes
  // uncompared and counts as skipped. Either way `plan` no longer runs the other path.
  std::optional<ShadowRunner::Slot> ReserveComparison(Plan* plan);
  // No comparison for this call (`why`: counted as a skip); a canary call serves reference.
  void ShedComparison(Plan* plan, const char* why);
  // Runs the plan's served path into `*served`. A custom path that fails, or whose output is not
  // finite, is recorded as an outcome (error; breach with its comparison) and the reference
  // serves the call instead: only a reference failure fails the call. `decoded`: a served custom
  // output that is finite is written to its o_out (lse_out) at once, and *delivered set.
  absl::Status RunServed(const Plan& plan, PreparedBundle& b, const CallContext& call,
                         const DecodedRequest& decoded, Path* served, bool* delivered);
  // The breach of a custom output with NaN/Inf, compared against the reference run on `b`.
  Outcome NonFiniteOutcome(PreparedBundle& b, const Plan& plan);
  // Runs the non-served path on `b`, compares custom against reference, records the outcome.
  // `served_custom_s`: the served custom path's time (0 when the reference served), judged
  // against --custom_timeout_ms like the custom path's time in shadow.
  Outcome CompareAndRecord(PreparedBundle& b, const Plan& plan, const std::string& request_id,
                           double served_custom_s);
  bool TooSlow(double custom_s) const;  // over --custom_timeout_ms (when set)
  std::string TimeoutReason(double custom_s) const;
  // A shadow tap's capture also holds the stack's output.
  struct StackOutput {
    const std::vector<uint16_t>* o = nullptr;
    std::string backend;
  };
  // `breach`: whether the capture counts as a breach's (otherwise it takes a requested slot).
  void Capture(PreparedBundle& b, const Plan& plan, const Outcome& o, const Tolerance& tol,
               bool has_oracle, const std::string& request_id, bool breach,
               const StackOutput* stack = nullptr);
  // The shadow tap's oracle sample: each output against the fp32 oracle.
  bool TapOracle(PreparedBundle& b, const std::vector<uint16_t>& stack, const std::string& backend,
                 const Tolerance& tol);
  bool DrawOracle();
  Tolerance tolerance() const;

  Engine* engine_;
  ModeController* controller_;
  Metrics* metrics_;
  ShadowRunner* shadow_;
  HandlerOptions opts_;
  Capturer* capturer_ = nullptr;
  const RegionRegistry* regions_ = nullptr;
  // Every outcome goes through here: the counters, the controller's gate and rollback window,
  // and the rollback it may cause (logged by the controller, counted here).
  void Record(const Outcome& o);
  std::atomic<int64_t> requests_{0}, request_errors_{0}, served_reference_{0}, served_custom_{0};
  std::atomic<int64_t> match_{0}, breach_{0}, error_{0}, skipped_{0};
  mutable absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

}  // namespace verifyd
