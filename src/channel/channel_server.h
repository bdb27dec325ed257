#pragma once
// The open call channels (verify.proto, OpenChannel; layout in src/channel/channel_layout.h).
// Each channel is a client's shared-memory object, mapped read-write as shm regions are (only
// the caller's own, guarded against a client that shrinks it), and one thread that waits on its
// request word and serves each call through `serve`: the same path as a Verify RPC's message.
// A channel opened over a Unix socket watches the process that opened it (a pidfd): when that
// process exits without closing the channel, the channel is closed within about a second.
// A channel belongs to the peer that opened it (src/common/peer.h): another peer may close it
// only as --region_sharing allows, and its calls name regions as that peer (the owner's rights,
// not more). Each process may hold --max_channels_per_client channels.
// A channel opened with call descriptors is in doorbell mode (doorbell_layout.h): its thread
// polls the doorbell word that the client's GPU writes, and serves each call through
// `serve_built`. A channel opened with a tap is in tap mode (tap_layout.h): its thread polls the
// ring the tap kernel fills and hands each fill to the TapServer. A channel opened with a
// serving switch is in switch mode (switch_control.h): its thread renews the switch's lease
// with the SwitchServer's directive and reads back what the stack's GPU counted.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "src/channel/channel_layout.h"
#include "src/channel/doorbell_layout.h"
#include "src/channel/switch_control.h"
#include "src/channel/tap_layout.h"
#include "src/common/change_signal.h"
#include "src/common/peer.h"
#include "src/common/process_watch.h"
#include "src/region/region_registry.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

struct ChannelLimits {
  int max_channels = 16;                      // --max_channels; 0: no channels
  int max_channels_per_client = 4;            // --max_channels_per_client (per process)
  Sharing sharing = Sharing::kUid;            // --region_sharing: who may close a channel
  uint64_t max_capacity = uint64_t{1} << 30;  // an area's bytes at most (--max_message_mb)
  // After a call, the most the channel's thread spins for the next one before it sleeps
  // (--channel_spin_us): twice the last gap between calls when that gap was within this,
  // otherwise kSpinFloor (channel::AdaptiveSpin). A call within the spin pays no wake-up.
  absl::Duration spin = absl::Microseconds(50);
  static constexpr absl::Duration kSpinFloor = absl::Microseconds(50);
  // Doorbell mode: past the spin, how long the thread naps between looks at the doorbell word
  // (--doorbell_poll_us). A GPU cannot wake a futex, so this bounds the wake-up of a call that
  // comes after a pause.
  absl::Duration doorbell_poll = absl::Microseconds(20);
};

// A tap channel's counts (verify.proto, TapInfo).
struct TapCounts {
  std::string backend;
  std::string kv_dtype;  // the stack's pool: "bf16" or "e4m3"
  int64_t calls = 0, taps = 0, dropped = 0, compared = 0, refused = 0, stack_breaches = 0;
  double worst_custom_vs_reference = 0, worst_stack_vs_reference = 0, worst_custom_vs_stack = 0;
};

// How one tap fill ended: compared (with the rel-L2 of each pair) or refused.
struct TapResult {
  bool compared = false;
  double custom_vs_reference = 0, stack_vs_reference = 0, custom_vs_stack = 0;
  bool stack_breach = false;  // the stack's output breached against the reference
  std::string error;          // refused: why
};

// What a tap channel needs from above the transport.
class TapServer {
 public:
  virtual ~TapServer() = default;
  // Compares one fill (or counts the error that kept it from being built) of channel `channel`,
  // opened by `owner` (whose regions the fill names).
  virtual TapResult Serve(const std::string& channel, const Peer& owner,
                          const channel::TapPlan& plan,
                          const absl::StatusOr<v1::VerifyRequest>& call) = 0;
  // Writes `bytes` bytes at `offset` of the tap's slots region (the TapControl words verifyd
  // owns), a region of the channel's `owner`.
  virtual absl::Status WriteControl(const Peer& owner, const channel::TapPlan& plan,
                                    uint64_t offset, const void* src, uint64_t bytes) = 0;
  // The fraction of calls to sample now (--shadow_sample_rate, followed live).
  virtual double SampleRate() = 0;
  // What the tap kernel counted since the last report: calls, sampled calls, drops.
  virtual void GpuCounts(const std::string& backend, int64_t calls, int64_t taps,
                         int64_t dropped) = 0;
};

// A switch channel's state, as status shows it (verify.proto, SwitchInfo).
struct SwitchState {
  std::string model;
  uint32_t layers = 0, lease_ms = 0;
  channel::SwitchDirective directive;  // the last one written
  channel::SwitchCounts counts;
  absl::Time last_step_seen = absl::InfinitePast();  // when verifyd saw `steps` move last
};

// What a switch channel needs from above the transport.
class SwitchServer {
 public:
  virtual ~SwitchServer() = default;
  // What the next steps should serve: from verifyd's mode (shadow: the stack; canary: a
  // fraction; custom: the op).
  virtual channel::SwitchDirective Directive() = 0;
  // What the stack's GPU counted since the last report: steps served by the op and by the
  // stack, and steps the op would have served but for an expired lease.
  virtual void StepCounts(const std::string& model, int64_t op_steps, int64_t stack_steps,
                          int64_t lease_expired) = 0;
  // Notified whenever the directive may have changed (a flip, a rollback): a switch channel
  // renews at once instead of at its next quarter lease. Null: renewals keep their period.
  virtual const ChangeSignal* DirectiveChanges() { return nullptr; }
};

// A tap channel to open: its plan and one call per slot (TapSlotCall).
struct TapOpen {
  channel::TapPlan plan;
  std::vector<v1::VerifyRequest> slot_calls;
};

struct ChannelSummary {
  std::string name, key, client;
  std::string owner;  // the peer that opened it (Peer::label)
  Peer by;
  uint64_t byte_size = 0;
  channel::Geometry geometry;
  int64_t calls = 0;
  bool stopped = false;  // the object shrank under the mapping: no more calls
  int client_pid = 0;    // the watched process; 0: none
  int descriptors = 0;   // doorbell mode: call descriptors; 0: serialized requests
  channel::DoorbellPlan plan;
  int64_t failed_calls = 0;                   // doorbell mode: calls answered with an error
  std::optional<TapCounts> tap;               // tap mode
  std::optional<SwitchState> serving_switch;  // switch mode
};

class ChannelServer {
 public:
  // Serves one call from its serialized VerifyRequest, which is in the channel's request area
  // where the client can write it (ParseRequestInPlace copies out what is checked); fills `resp`
  // (errors in its error_code and error_message). `owner`: the peer that opened the channel, as
  // whom the call names regions.
  using Serve =
      std::function<void(const Peer& owner, absl::string_view request, v1::VerifyResponse* resp)>;
  // Serves one doorbell call, built from its descriptor and layout slot (or the error that kept
  // it from being built), into `resp`; on any error it zero-fills the output ranges that
  // `descriptor` names (null: the doorbell named no descriptor), so the client reads zeros, not
  // stale values. `layout_key`: the call's layout for reuse (BundleView::layout_key), 0 for none.
  using ServeBuilt = std::function<void(
      const Peer& owner, const absl::StatusOr<v1::VerifyRequest>& call,
      const v1::VerifyRequest* descriptor, uint64_t layout_key, v1::VerifyResponse* resp)>;
  using Descriptors = google::protobuf::RepeatedPtrField<v1::VerifyRequest>;
  // Sees the channel count after every change (metrics).
  using Observer = std::function<void(int64_t channels)>;

  // `pin_host`: pins each channel's memory for the engine's copy engines, so that bytes read in
  // place go to the GPU without a staging copy (null, or an error: they are staged).
  ChannelServer(ChannelLimits limits, Serve serve, ServeBuilt serve_built,
                RegionRegistry::HostPinner pin_host = nullptr);
  ~ChannelServer();  // closes every channel
  ChannelServer(const ChannelServer&) = delete;
  ChannelServer& operator=(const ChannelServer&) = delete;
  void SetObserver(Observer o);
  // Serves tap channels (null: Open refuses a tap). Set before the first Open; outlives the
  // server's channels.
  void SetTapServer(TapServer* t) { tap_server_ = t; }
  // Serves switch channels (null: Open refuses one). Set before the first Open; outlives the
  // server's channels.
  void SetSwitchServer(SwitchServer* s) { switch_server_ = s; }
  // Sees each refused close of another peer's channel (metrics, audit). Set before serving.
  void SetDenialObserver(DenialObserver o) { on_denial_ = std::move(o); }

  // Maps `key` (the caller's own object when its uid is known; MapShm), writes the header
  // and starts serving. ALREADY_EXISTS for a name in use, RESOURCE_EXHAUSTED past
  // --max_channels or --max_channels_per_client, INVALID_ARGUMENT naming the field for a bad
  // name or size. `by`: the opening peer, which owns the channel; its pid is the process whose
  // exit closes the channel (none: none is watched).
  // `descriptors` (non-empty: doorbell mode) and `layout_slots` as in OpenChannelRequest; bad
  // ones are INVALID_ARGUMENT naming the field (PlanDoorbell). `tap`: tap mode (the caller
  // planned it with PlanTap against limits() and checked its region). `serving_switch`: switch
  // mode (planned here with PlanSwitch against `build`, verifyd's build).
  absl::StatusOr<ChannelSummary> Open(const std::string& name, const std::string& key,
                                      uint64_t byte_size, const std::string& client, const Peer& by,
                                      const Descriptors& descriptors = Descriptors(),
                                      uint32_t layout_slots = 0,
                                      std::optional<TapOpen> tap = std::nullopt,
                                      const v1::SwitchSpec* serving_switch = nullptr,
                                      absl::string_view build = "");
  const ChannelLimits& limits() const { return limits_; }
  // Closes `name`, or with an empty name every channel of `client` that `caller` may close; a
  // call in progress finishes first. The client sees state closed. NOT_FOUND for an unknown name,
  // PERMISSION_DENIED naming it for another peer's channel.
  absl::StatusOr<std::vector<std::string>> Close(const std::string& name, const std::string& client,
                                                 const Peer& caller);
  std::vector<ChannelSummary> List() const;

 private:
  class Channel;
  void Notify();
  // Closes the channels whose client exited, every so often, until the server goes.
  void ReapLoop();

  ChannelLimits limits_;
  Serve serve_;
  ServeBuilt serve_built_;
  RegionRegistry::HostPinner pin_host_;
  TapServer* tap_server_ = nullptr;
  SwitchServer* switch_server_ = nullptr;
  DenialObserver on_denial_;
  Observer observer_;
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Channel>> channels_;  // guarded by mu_
  std::condition_variable reap_cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread reaper_;
};

}  // namespace verifyd
