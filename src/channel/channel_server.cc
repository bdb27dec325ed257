#include "src/channel/channel_server.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <thread>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/channel/futex_word.h"
#include "src/region/host_pinning.h"
#include "src/region/shm_mapping.h"
#include "src/transport/in_band_error.h"

namespace verifyd {

using channel::HeaderOf;

// One open channel: its mapping and the thread that serves it.
class ChannelServer::Channel {
 public:
  Channel(ChannelSummary summary, std::unique_ptr<MappedRegion> map, const ChannelLimits& limits,
          const Serve& serve, const ServeBuilt& serve_built, const Descriptors& descriptors,
          std::optional<TapOpen> tap, TapServer* tap_server,
          std::optional<channel::SwitchPlan> serving_switch, SwitchServer* switch_server)
      : summary_(std::move(summary)),
        map_(std::move(map)),
        spin_(limits.spin),
        poll_(limits.doorbell_poll),
        serve_(serve),
        serve_built_(serve_built),
        descriptors_(descriptors),
        tap_(std::move(tap)),
        tap_server_(tap_server),
        switch_(std::move(serving_switch)),
        switch_server_(switch_server),
        client_(summary_.client_pid) {
    channel::InitHeader(map_->base(), summary_.geometry);
    if (tap_) {
      tap_counts_.backend = tap_->plan.spec.backend();
      tap_counts_.kv_dtype = tap_->plan.spec.kv_dtype() == v1::DTYPE_F8E4M3 ? "e4m3" : "bf16";
    }
    if (switch_) {
      switch_state_.model = switch_->spec.model();
      switch_state_.layers = switch_->spec.layers();
      switch_state_.lease_ms = switch_->lease_ms;
      // The first renewal before OpenChannel answers: the client's first step sees the mode.
      RenewSwitchOnce();
    }
    thread_ = std::thread([this] {
      if (switch_) {
        SwitchLoop();
      } else if (tap_) {
        TapLoop();
      } else if (!descriptors_.empty()) {
        DoorbellLoop();
      } else {
        Loop();
      }
    });
  }
  ~Channel() {
    stop_.store(true);
    channel::FutexWake(&HeaderOf(map_->base())->request_seq);  // a sleeping Loop looks again
    thread_.join();
    channel::Header* h = HeaderOf(map_->base());
    h->state.store(channel::kStateClosed, std::memory_order_release);
    channel::FutexWake(&h->response_seq);  // a client waiting for an answer sees the close
  }

  // The client that opened it exited, and the channel serves no more.
  bool orphaned() const { return orphaned_.load(); }
  // What does not change while it is open (its name, owner, plan).
  const ChannelSummary& summary_ref() const { return summary_; }

  ChannelSummary summary() const {
    ChannelSummary s = summary_;
    s.calls = calls_.load();
    s.stopped = stopped_.load();
    s.failed_calls = failed_.load();
    if (tap_) {
      std::lock_guard<std::mutex> l(tap_mu_);
      s.tap = tap_counts_;
      const channel::Header* h = HeaderOf(map_->base());
      s.tap->calls = h->tap_calls.load(std::memory_order_relaxed);
      s.tap->taps = h->tap_taps.load(std::memory_order_relaxed);
      s.tap->dropped = h->tap_dropped.load(std::memory_order_relaxed);
    }
    if (switch_) {
      std::lock_guard<std::mutex> l(switch_mu_);
      s.serving_switch = switch_state_;
    }
    return s;
  }

 private:
  // The client shrank the object under the mapping (what a call read of it was zeros): the
  // channel stops serving, and the loop returns.
  bool Shrank() {
    if (map_->intact()) return false;
    spdlog::warn(
        "channel '{}': its shared-memory object shrank under the mapping; the channel stops "
        "serving (close it and open a new one)",
        summary_.name);
    stopped_.store(true);
    return true;
  }

  // The client exited (and the channel closes), or it is being closed: the loop returns.
  bool Ended() {
    if (stop_.load()) return true;
    if (!client_.gone()) return false;
    spdlog::info("channel '{}': its client (pid {}) exited without closing it; closing it",
                 summary_.name, summary_.client_pid);
    orphaned_.store(true);
    return true;
  }

  // Doorbell and tap modes: waits until `ready()` (a word the client's GPU writes); false when
  // the loop should end. Spins for `spin`, then naps for poll_ between looks (a GPU cannot wake
  // a futex), and every 100 ms looks at the client's process and calls `every_100ms`.
  template <typename Ready, typename Periodic>
  bool AwaitGpuWord(Ready ready, absl::Duration spin, Periodic every_100ms) {
    const absl::Time spin_end = absl::Now() + spin;
    absl::Time next_check = absl::Now() + absl::Milliseconds(100);
    bool napping = false;
    for (uint64_t i = 0;; ++i) {
      if (ready()) return true;
      if (stop_.load()) return false;
      if (!napping && (i & 63) != 0) continue;  // spinning: the clock every 64 looks
      const absl::Time now = absl::Now();
      if (now >= next_check) {
        if (Ended()) return false;
        every_100ms();
        next_check = now + absl::Milliseconds(100);
      }
      napping = napping || now >= spin_end;
      if (napping) std::this_thread::sleep_for(absl::ToChronoMicroseconds(poll_));
    }
  }

  // Doorbell mode: the next doorbell word, taken (0 left in its place); 0 when the loop should
  // end.
  uint32_t AwaitRing(channel::Header* h, absl::Duration spin) {
    const bool rung =
        AwaitGpuWord([h] { return h->doorbell.load(std::memory_order_acquire) != 0; }, spin, [] {});
    return rung ? h->doorbell.exchange(0, std::memory_order_acq_rel) : 0;
  }

  // Tap mode: verifyd's words of the slots region's TapControl (the sample rate and the fills
  // handed back), one 16-byte write. A failure is logged once.
  void WriteVerifydWords(uint32_t ppm, uint32_t consumed) {
    const tap::TapVerifydWords w{ppm, consumed, {0, 0}};
    absl::Status st = tap_server_->WriteControl(summary_.by, tap_->plan, 0, &w, sizeof(w));
    if (st.ok()) {
      sample_ppm_ = ppm;
    } else if (!control_failed_) {
      control_failed_ = true;
      spdlog::warn("channel '{}': writing its tap's control words: {}", summary_.name,
                   st.ToString());
    }
  }

  // Tap mode: the sample rate, when it changed (and at start).
  void FollowSampleRate() {
    const double rate = tap_server_->SampleRate();
    const auto ppm = static_cast<uint32_t>(std::clamp(rate, 0.0, 1.0) * tap::kPpmAll + 0.5);
    if (ppm != sample_ppm_) WriteVerifydWords(ppm, consumed_);
  }

  // Tap mode: what the tap kernel counted since the last report, to the TapServer.
  void ReportGpuCounts() {
    const channel::Header* h = HeaderOf(map_->base());
    const uint32_t now[3] = {h->tap_calls.load(std::memory_order_relaxed),
                             h->tap_taps.load(std::memory_order_relaxed),
                             h->tap_dropped.load(std::memory_order_relaxed)};
    int64_t delta[3];
    for (int i = 0; i < 3; ++i) {
      delta[i] = static_cast<uint32_t>(now[i] - gpu_seen_[i]);  // the counts wrap at 2^32
      gpu_seen_[i] = now[i];
    }
    if (delta[0] + delta[1] + delta[2] > 0) {
      tap_server_->GpuCounts(tap_->plan.spec.backend(), delta[0], delta[1], delta[2]);
    }
  }

  // Switch mode: one renewal with the SwitchServer's directive, and what the GPU counted since
  // the last one, to the state and the SwitchServer.
  void RenewSwitchOnce() {
    char* block = map_->base() + switch_->block_offset;
    const channel::SwitchDirective d = switch_server_->Directive();
    channel::RenewSwitch(block, d, switch_->lease_ms);
    const channel::SwitchCounts c = channel::ReadSwitch(block);
    int64_t op = 0, stack = 0, expired = 0;
    {
      std::lock_guard<std::mutex> l(switch_mu_);
      SwitchState& st = switch_state_;
      // The GPU's counts only grow; a block the client rewrote from zero restarts them.
      if (c.steps >= st.counts.steps && c.op_steps >= st.counts.op_steps &&
          c.lease_expired >= st.counts.lease_expired) {
        op = static_cast<int64_t>(c.op_steps - st.counts.op_steps);
        stack = static_cast<int64_t>(c.steps - st.counts.steps) - op;
        expired = static_cast<int64_t>(c.lease_expired - st.counts.lease_expired);
      }
      if (c.steps != st.counts.steps) st.last_step_seen = absl::Now();
      if (d.path != st.directive.path || d.canary_fraction != st.directive.canary_fraction) {
        spdlog::info("channel '{}': the switch of model '{}' now asks for {}{}", summary_.name,
                     st.model, channel::SwitchPathName(d.path),
                     d.path == channel::SwitchPath::kCanary
                         ? absl::StrCat(" (", d.canary_fraction, " of the steps)")
                         : std::string());
      }
      st.directive = d;
      st.counts = c;
    }
    if (op + stack + expired > 0) {
      switch_server_->StepCounts(switch_->spec.model(), op, std::max<int64_t>(stack, 0), expired);
    }
  }

  void SwitchLoop() {
    const absl::Duration period = absl::Milliseconds(switch_->lease_ms) / 4;
    const absl::Duration slice = std::min(period, absl::Milliseconds(20));
    // A change of the directive (a flip, a rollback) renews at once: the next step serves it.
    const ChangeSignal* changes = switch_server_->DirectiveChanges();
    uint64_t seen = changes != nullptr ? changes->generation() : 0;
    // A change made between the channel's opening and this thread's start is in `seen` already
    // and would wake nothing: renew once now, so that the block holds it.
    if (Shrank()) return;
    if (!stop_.load() && !Ended()) RenewSwitchOnce();
    absl::Time next = absl::Now() + period;
    while (true) {
      while (absl::Now() < next) {
        if (stop_.load()) break;
        const absl::Duration wait = std::min(slice, next - absl::Now());
        if (changes == nullptr) {
          std::this_thread::sleep_for(absl::ToChronoMicroseconds(wait));
        } else if (const uint64_t g = changes->WaitFor(seen, wait); g != seen) {
          seen = g;
          break;
        }
      }
      if (Shrank()) return;
      if (stop_.load() || Ended()) break;
      RenewSwitchOnce();
      next += period;
      if (next < absl::Now()) next = absl::Now() + period;  // verifyd was stopped: no burst
    }
    channel::HandBackSwitch(map_->base() + switch_->block_offset);
  }

  void TapLoop() {
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    char* base = map_->base();
    channel::Header* h = HeaderOf(base);
    const channel::TapPlan& plan = tap_->plan;
    const uint32_t slots = plan.spec.slots();
    const char* records = base + summary_.geometry.request_offset;
    uint32_t& consumed = consumed_;
    absl::StatusOr<v1::VerifyRequest> call;
    absl::Time next_rate = absl::Now();
    while (true) {
      if (absl::Now() >= next_rate) {  // a busy ring too follows the rate
        FollowSampleRate();
        next_rate = absl::Now() + absl::Milliseconds(100);
      }
      const bool filled = AwaitGpuWord(
          [h, consumed] { return h->tap_produced.load(std::memory_order_acquire) != consumed; },
          ChannelLimits::kSpinFloor,
          [this] {
            FollowSampleRate();
            ReportGpuCounts();
          });
      if (!filled) return;
      const uint32_t slot = consumed % slots;
      if (!call.ok()) call = v1::VerifyRequest();
      uint32_t number = 0;
      absl::Status built = channel::BuildTapCall(
          plan, tap_->slot_calls[slot], records + uint64_t{slot} * plan.geometry.record_bytes,
          &*call, &number);
      if (!built.ok()) call = built;
      const TapResult r = tap_server_->Serve(summary_.name, summary_.by, plan, call);
      if (Shrank()) return;
      ++consumed;
      WriteVerifydWords(sample_ppm_, consumed);
      int64_t refused = 0;
      {
        std::lock_guard<std::mutex> l(tap_mu_);
        TapCounts& c = tap_counts_;
        if (r.compared) {
          ++c.compared;
          c.stack_breaches += r.stack_breach ? 1 : 0;
          c.worst_custom_vs_reference =
              std::max(c.worst_custom_vs_reference, r.custom_vs_reference);
          c.worst_stack_vs_reference = std::max(c.worst_stack_vs_reference, r.stack_vs_reference);
          c.worst_custom_vs_stack = std::max(c.worst_custom_vs_stack, r.custom_vs_stack);
        } else {
          refused = ++c.refused;
        }
        h->tap_compared.store(static_cast<uint32_t>(c.compared), std::memory_order_relaxed);
        h->tap_refused.store(static_cast<uint32_t>(c.refused), std::memory_order_relaxed);
      }
      h->tap_consumed.store(consumed, std::memory_order_release);
      calls_.fetch_add(1);
      ReportGpuCounts();
      if (refused > 0 && (refused & (refused - 1)) == 0) {  // the 1st, 2nd, 4th, ... refusal
        spdlog::warn("channel '{}': tap call {} refused: {} ({} refused so far)", summary_.name,
                     number, call.ok() ? r.error : call.status().ToString(), refused);
      }
    }
  }

  void DoorbellLoop() {
    // Naps of poll_ would otherwise last 50 us more: the default timer slack.
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    char* base = map_->base();
    channel::Header* h = HeaderOf(base);
    const channel::Geometry& g = summary_.geometry;
    v1::VerifyResponse resp;
    absl::StatusOr<v1::VerifyRequest> call;
    absl::Duration last_gap = absl::InfiniteDuration();
    absl::Time answered = absl::InfinitePast();
    while (true) {
      const uint32_t word =
          AwaitRing(h, channel::AdaptiveSpin(last_gap, ChannelLimits::kSpinFloor, spin_));
      if (word == 0) return;
      last_gap = absl::Now() - answered;
      const channel::Ring ring = channel::DecodeRing(word);
      resp.Clear();
      if (!call.ok()) call = v1::VerifyRequest();
      uint32_t generation = 0;
      absl::Status built = channel::BuildDoorbellCall(descriptors_, summary_.plan, ring,
                                                      base + g.request_offset, &*call, &generation);
      if (!built.ok()) call = built;
      const v1::VerifyRequest* descriptor =
          ring.descriptor < static_cast<uint32_t>(descriptors_.size())
              ? &descriptors_[static_cast<int>(ring.descriptor)]
              : nullptr;
      serve_built_(summary_.by, call, descriptor,
                   built.ok() ? channel::LayoutKey(serial_, ring.slot, generation) : 0, &resp);
      if (Shrank()) return;
      if (resp.error_code() != 0) {
        const int64_t failed = failed_.fetch_add(1) + 1;
        h->failed_calls.store(static_cast<uint32_t>(failed), std::memory_order_relaxed);
        if ((failed & (failed - 1)) == 0) {  // the 1st, 2nd, 4th, ... failure
          spdlog::warn(
              "channel '{}': call (descriptor {}, layout slot {}) failed: {} ({} failed "
              "so far; its o_out was zero-filled)",
              summary_.name, ring.descriptor, ring.slot, resp.error_message(), failed);
        }
      }
      size_t bytes = resp.ByteSizeLong();
      if (bytes <= g.capacity) {
        resp.SerializeWithCachedSizesToArray(
            reinterpret_cast<uint8_t*>(channel::ResponseArea(base, g)));
      } else {
        bytes = 0;  // an answer that large carries tensors, which a doorbell call never returns
      }
      h->response_bytes.store(static_cast<uint32_t>(bytes), std::memory_order_relaxed);
      calls_.fetch_add(1);
      h->done.store(channel::DoneWord(resp.error_code()), std::memory_order_release);
      answered = absl::Now();
    }
  }

  void Loop() {
    char* base = map_->base();
    channel::Header* h = HeaderOf(base);
    const channel::Geometry& g = summary_.geometry;
    // InitHeader set it to 0 before this thread started; the client may ring as soon as
    // OpenChannel answers, before this line runs, so the count starts from there, not from a load.
    uint32_t served = 0;
    v1::VerifyResponse resp;
    // From the last answer to the call after it: how long the next spin is.
    absl::Duration last_gap = absl::InfiniteDuration();
    absl::Time answered = absl::InfinitePast();
    while (!stop_.load()) {
      const uint32_t seq = channel::AwaitChange(
          &h->request_seq, served,
          channel::AdaptiveSpin(last_gap, ChannelLimits::kSpinFloor, spin_),
          absl::Milliseconds(100), [this] { return stop_.load() || client_.gone(); });
      if (seq == served) {  // asked to stop, or the client is gone
        if (!stop_.load() && Ended()) return;
        continue;
      }
      served = seq;
      last_gap = absl::Now() - answered;
      resp.Clear();
      absl::StatusOr<absl::string_view> request = channel::RequestIn(base, g);
      if (request.ok()) {
        serve_(summary_.by, *request, &resp);
      } else {
        ErrorInResponse(request.status(), "", &resp);  // no request was parsed: no request id
      }
      if (Shrank()) return;  // what the call read of the area was zeros
      size_t bytes = resp.ByteSizeLong();
      if (bytes > g.capacity) {
        ErrorInResponse(
            absl::ResourceExhaustedError(absl::StrCat(
                "o: the response of ", bytes, " bytes does not fit the channel's ", g.capacity,
                "-byte response area; name o_out (and lse_out) to have "
                "the output written in place, or open a larger channel")),
            std::string(resp.request_id()), &resp);
        bytes = resp.ByteSizeLong();
      }
      resp.SerializeWithCachedSizesToArray(
          reinterpret_cast<uint8_t*>(channel::ResponseArea(base, g)));
      // Counted before the client can see its answer: a status read after the call includes it.
      calls_.fetch_add(1);
      channel::PublishResponse(base, static_cast<uint32_t>(bytes), seq);
      channel::FutexWake(&h->response_seq);
      answered = absl::Now();
    }
  }

  const ChannelSummary summary_;
  const std::unique_ptr<MappedRegion> map_;
  const absl::Duration spin_, poll_;
  const Serve& serve_;
  const ServeBuilt& serve_built_;
  const Descriptors descriptors_;
  const std::optional<TapOpen> tap_;
  TapServer* const tap_server_;
  uint32_t sample_ppm_ = 0xffffffffu;  // tap mode: the rate last written (none yet)
  uint32_t consumed_ = 0;              // tap mode: the fills handed back
  bool control_failed_ = false;        // tap mode: a control write failed (logged once)
  uint32_t gpu_seen_[3] = {0, 0, 0};   // tap mode: the GPU's counts last reported
  mutable std::mutex tap_mu_;
  TapCounts tap_counts_;  // guarded by tap_mu_
  const std::optional<channel::SwitchPlan> switch_;
  SwitchServer* const switch_server_;
  mutable std::mutex switch_mu_;
  SwitchState switch_state_;   // guarded by switch_mu_
  const ProcessWatch client_;  // the process that opened it (pid 0: none is watched)
  // Its number among the channels this process opened (its calls' layout keys: LayoutKey).
  const uint32_t serial_ = next_serial_.fetch_add(1, std::memory_order_relaxed) + 1;
  static inline std::atomic<uint32_t> next_serial_{0};
  std::atomic<bool> stop_{false}, stopped_{false}, orphaned_{false};
  std::atomic<int64_t> calls_{0}, failed_{0};
  std::thread thread_;
};

ChannelServer::ChannelServer(ChannelLimits limits, Serve serve, ServeBuilt serve_built,
                             RegionRegistry::HostPinner pin_host)
    : limits_(limits),
      serve_(std::move(serve)),
      serve_built_(std::move(serve_built)),
      pin_host_(std::move(pin_host)) {
  if (limits_.max_channels > 0) reaper_ = std::thread([this] { ReapLoop(); });
}

ChannelServer::~ChannelServer() {
  std::map<std::string, std::unique_ptr<Channel>> all;
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
    all.swap(channels_);
  }
  reap_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  all.clear();
}

void ChannelServer::ReapLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!reap_cv_.wait_for(l, std::chrono::milliseconds(250), [this] { return stopping_; })) {
    std::vector<std::unique_ptr<Channel>> gone;
    for (auto it = channels_.begin(); it != channels_.end();) {
      if (!it->second->orphaned()) {
        ++it;
        continue;
      }
      gone.push_back(std::move(it->second));
      it = channels_.erase(it);
    }
    if (gone.empty()) continue;
    l.unlock();
    gone.clear();  // their threads have returned already
    Notify();
    l.lock();
  }
}

void ChannelServer::SetObserver(Observer o) {
  {
    std::lock_guard<std::mutex> l(mu_);
    observer_ = std::move(o);
  }
  Notify();
}

void ChannelServer::Notify() {
  Observer o;
  int64_t n;
  {
    std::lock_guard<std::mutex> l(mu_);
    o = observer_;
    n = static_cast<int64_t>(channels_.size());
  }
  if (o) o(n);
}

absl::StatusOr<ChannelSummary> ChannelServer::Open(
    const std::string& name, const std::string& key, uint64_t byte_size, const std::string& client,
    const Peer& by, const Descriptors& descriptors, uint32_t layout_slots,
    std::optional<TapOpen> tap, const v1::SwitchSpec* serving_switch, absl::string_view build) {
  if (limits_.max_channels == 0) {
    return absl::FailedPreconditionError(
        "OpenChannel: this verifyd serves no call channels (--max_channels=0)");
  }
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("name: must have 1 to 128 characters");
  }
  absl::StatusOr<channel::Geometry> g = channel::GeometryFor(byte_size, limits_.max_capacity);
  if (!g.ok()) return g.status();
  channel::DoorbellPlan plan;
  if (!descriptors.empty()) {
    absl::StatusOr<channel::DoorbellPlan> p =
        channel::PlanDoorbell(descriptors, layout_slots, g->capacity);
    if (!p.ok()) return p.status();
    plan = *p;
  } else if (layout_slots != 0) {
    return absl::InvalidArgumentError("layout_slots: set without descriptors (doorbell mode)");
  }
  if (tap && !descriptors.empty()) {
    return absl::InvalidArgumentError(
        "tap: a channel is in doorbell mode or in tap mode, not both");
  }
  if (tap && tap_server_ == nullptr) {
    return absl::FailedPreconditionError("tap: this verifyd serves no tap channels");
  }
  std::optional<channel::SwitchPlan> switch_plan;
  if (serving_switch != nullptr) {
    if (tap || !descriptors.empty()) {
      return absl::InvalidArgumentError(
          "serving_switch: a channel is in one mode (doorbell, tap or switch), not two");
    }
    if (switch_server_ == nullptr) {
      return absl::FailedPreconditionError(
          "serving_switch: this verifyd serves no switch channels");
    }
    absl::StatusOr<channel::SwitchPlan> p = channel::PlanSwitch(*serving_switch, build, *g);
    if (!p.ok()) return p.status();
    switch_plan = std::move(*p);
  }
  auto check_room = [&]() -> absl::Status {
    if (channels_.count(name) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: channel '", name, "' is already open (close it first)"));
    }
    if (static_cast<int64_t>(channels_.size()) >= limits_.max_channels) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "name: ", channels_.size(), " channels are open, the most --max_channels allows"));
    }
    int64_t mine = 0;
    for (const auto& [n, c] : channels_) mine += c->summary_ref().owner == by.label ? 1 : 0;
    if (mine >= limits_.max_channels_per_client) {
      return absl::ResourceExhaustedError(
          absl::StrCat("name: client ", by.label, " has ", mine,
                       " channels open, the most --max_channels_per_client (",
                       limits_.max_channels_per_client, ") allows (close one first)"));
    }
    return absl::OkStatus();
  };
  {
    std::lock_guard<std::mutex> l(mu_);
    if (absl::Status st = check_room(); !st.ok()) return st;
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = MapShm(key, 0, byte_size, by.uid);
  if (!m.ok()) return m.status();
  // The areas only: the header's futex words stay ordinary pages.
  PinnedHost pinned =
      PinHost(pin_host_, (*m)->base() + channel::kHeaderBytes, byte_size - channel::kHeaderBytes,
              absl::StrCat("channel '", name, "'"));
  if (pinned.unpin) (*m)->SetBeforeUnmap(std::move(pinned.unpin));
  ChannelSummary s;
  s.name = name;
  s.key = key;
  s.client = client;
  s.byte_size = byte_size;
  s.geometry = *g;
  s.client_pid = by.pid.value_or(0);
  s.owner = by.label;
  s.by = by;
  s.descriptors = descriptors.size();
  s.plan = plan;
  const std::string tap_note =
      tap           ? absl::StrCat("; tap mode, backend ", tap->plan.spec.backend(), ", ",
                                   tap->plan.spec.slots(), " slots of ", tap->plan.geometry.slot_bytes,
                                   " bytes in region '", tap->plan.spec.region(), "'")
      : switch_plan ? absl::StrCat("; switch mode, model ", switch_plan->spec.model(), ", ",
                                   switch_plan->spec.layers(), " layers, lease of ",
                                   switch_plan->lease_ms, " ms")
                    : std::string();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (absl::Status st = check_room(); !st.ok()) return st;  // raced with another Open
    channels_[name] = std::make_unique<Channel>(s, std::move(*m), limits_, serve_, serve_built_,
                                                descriptors, std::move(tap), tap_server_,
                                                std::move(switch_plan), switch_server_);
  }
  spdlog::info(
      "channel '{}' open on '{}' ({} bytes, areas of {} bytes, client '{}'{}{}; pinned in "
      "{:.1f} ms)",
      name, key, byte_size, g->capacity, client,
      descriptors.empty() ? std::string()
                          : absl::StrCat("; doorbell mode, ", descriptors.size(),
                                         " descriptors, max_batch ", plan.max_batch),
      tap_note, absl::ToDoubleMilliseconds(pinned.took));
  Notify();
  return s;
}

absl::StatusOr<std::vector<std::string>> ChannelServer::Close(const std::string& name,
                                                              const std::string& client,
                                                              const Peer& caller) {
  std::vector<std::unique_ptr<Channel>> closing;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!name.empty()) {
      auto it = channels_.find(name);
      if (it == channels_.end()) {
        return absl::NotFoundError(absl::StrCat("name: no open channel '", name, "'"));
      }
      const ChannelSummary& s = it->second->summary_ref();
      if (!MayUse(limits_.sharing, s.by, caller)) {
        if (on_denial_) {
          on_denial_(
              Denial{"channel", absl::StrCat("channel '", name, "'"), "close", &caller, s.owner});
        }
        return absl::PermissionDeniedError(
            absl::StrCat("name: channel '", name, "' belongs to ", s.owner, ", not to the caller (",
                         caller.label.empty() ? "unverified" : caller.label,
                         "); --region_sharing=", SharingName(limits_.sharing), " lets ",
                         limits_.sharing == Sharing::kProcess ? "only the process that opened it"
                                                              : "only its uid",
                         " close it"));
      }
      names.push_back(name);
      closing.push_back(std::move(it->second));
      channels_.erase(it);
    } else {
      for (auto it = channels_.begin(); it != channels_.end();) {
        // Another peer's channels of that client name are not the caller's: left alone.
        const ChannelSummary& s = it->second->summary_ref();
        if (s.client != client || !MayUse(limits_.sharing, s.by, caller)) {
          ++it;
          continue;
        }
        names.push_back(it->first);
        closing.push_back(std::move(it->second));
        it = channels_.erase(it);
      }
    }
  }
  closing.clear();  // each waits for its call in progress
  for (const std::string& n : names) spdlog::info("channel '{}' closed", n);
  Notify();
  return names;
}

std::vector<ChannelSummary> ChannelServer::List() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<ChannelSummary> out;
  for (const auto& [n, c] : channels_) out.push_back(c->summary());
  return out;
}

}  // namespace verifyd
