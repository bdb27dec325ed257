#include "src/transport/stream_limiter.h"

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/common/peer.h"
#include "src/transport/unix_socket_acceptor.h"

namespace verifyd {

std::string ShareKey(const std::string& grpc_peer) {
  if (absl::StartsWith(grpc_peer, "fd:")) {
    const std::optional<uint32_t> uid = UnixPeerUid(grpc_peer);
    return uid ? UidShareKey(*uid) : "an unverified Unix-socket peer";
  }
  // "ipv4:10.0.0.7:41234", "ipv6:[::1]:41234": the host is all but the last ":port".
  const size_t colon = grpc_peer.rfind(':');
  const size_t scheme = grpc_peer.find(':');
  return colon != std::string::npos && colon != scheme ? grpc_peer.substr(0, colon) : grpc_peer;
}

StreamLimiter::StreamLimiter(StreamLimits limits, Refused refused)
    : limits_(limits), refused_(std::move(refused)) {
  if (limits_.idle_timeout > absl::ZeroDuration() || limits_.body_timeout > absl::ZeroDuration()) {
    reaper_ = std::thread([this] { Reap(); });
  }
}

StreamLimiter::~StreamLimiter() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

int StreamLimiter::CountLocked(const std::string& peer, bool call) const {
  int n = 0;
  for (const auto& [ctx, o] : open_) {
    // A call counts while it waits for its message: one being served holds its thread for work.
    n += o.call == call && o.peer == peer && (!call || o.last != Clock::time_point::max()) ? 1 : 0;
  }
  return n;
}

absl::Status StreamLimiter::Open(grpc::ServerContext* ctx) {
  const std::string peer = ShareKey(ctx->peer());
  absl::MutexLock l(&mu_);
  if (streams_ >= limits_.max_streams) {
    if (refused_) refused_("stream", "ceiling");
    return absl::ResourceExhaustedError(absl::StrCat(
        "streams: ", streams_,
        " streams are open, the most --grpc_max_streams=", limits_.max_streams,
        " allows (the rest of the threads serve unary calls); send on an open stream, close "
        "idle ones, or use unary calls or call channels"));
  }
  if (const int mine = CountLocked(peer, false); mine >= limits_.max_streams_per_peer) {
    if (refused_) refused_("stream", "peer_share");
    return absl::ResourceExhaustedError(absl::StrCat(
        "streams: ", peer, " has ", mine,
        " streams open, the most --grpc_max_streams_per_peer=", limits_.max_streams_per_peer,
        " allows (each peer gets a share, so that none takes every stream); send on an open "
        "stream or close idle ones"));
  }
  open_[ctx] = Open_{peer, Clock::now(), false, false};
  ++streams_;
  return absl::OkStatus();
}

void StreamLimiter::Touch(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  if (auto it = open_.find(ctx); it != open_.end() && !it->second.cancelled) {
    it->second.last = Clock::now();
  }
}

void StreamLimiter::Close(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  if (open_.erase(ctx) > 0) --streams_;
}

absl::Status StreamLimiter::BeginCall(grpc::ServerContext* ctx) {
  const std::string peer = ShareKey(ctx->peer());
  absl::MutexLock l(&mu_);
  if (const int mine = CountLocked(peer, true); mine >= limits_.max_waiting_calls_per_peer) {
    if (refused_) refused_("call", "peer_share");
    return absl::ResourceExhaustedError(absl::StrCat(
        "calls: ", peer, " has ", mine, " Verify calls waiting for their message, the most ",
        "--grpc_max_waiting_calls_per_peer=", limits_.max_waiting_calls_per_peer,
        " allows (each holds a server thread until its message arrives); send each call's "
        "message with its headers"));
  }
  const auto deadline = limits_.body_timeout > absl::ZeroDuration()
                            ? Clock::now() + absl::ToChronoNanoseconds(limits_.body_timeout)
                            : Clock::time_point::max();
  open_[ctx] = Open_{peer, deadline, true, false};
  return absl::OkStatus();
}

void StreamLimiter::Arrived(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  if (auto it = open_.find(ctx); it != open_.end()) it->second.last = Clock::time_point::max();
}

void StreamLimiter::EndCall(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  open_.erase(ctx);
}

int StreamLimiter::open() const {
  absl::MutexLock l(&mu_);
  return streams_;
}

int64_t StreamLimiter::idle_cancelled() const {
  absl::MutexLock l(&mu_);
  return idle_cancelled_;
}

int64_t StreamLimiter::body_cancelled() const {
  absl::MutexLock l(&mu_);
  return body_cancelled_;
}

void StreamLimiter::Reap() {
  const auto idle = limits_.idle_timeout > absl::ZeroDuration()
                        ? absl::ToChronoNanoseconds(limits_.idle_timeout)
                        : std::chrono::nanoseconds::max();
  absl::Duration period = absl::Seconds(1);
  for (absl::Duration t : {limits_.idle_timeout, limits_.body_timeout}) {
    if (t > absl::ZeroDuration()) period = std::min(period, t / 4);
  }
  period = std::max(period, absl::Milliseconds(20));
  absl::MutexLock l(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
    const auto now = Clock::now();
    for (auto& [ctx, o] : open_) {
      if (o.cancelled) continue;
      const bool expired = o.call ? now >= o.last : now - o.last >= idle;
      if (!expired) continue;
      // Cancelled under the lock: Close() and EndCall() take it too, so the context is alive.
      ctx->TryCancel();
      o.cancelled = true;
      if (o.call) {
        ++body_cancelled_;
        if (refused_) refused_("call", "body_timeout");
        spdlog::warn("a Verify call from {} sent no message within {}; cancelled", o.peer,
                     absl::FormatDuration(limits_.body_timeout));
      } else {
        ++idle_cancelled_;
        spdlog::warn("a data-plane stream from {} sent nothing for {}; cancelled", o.peer,
                     absl::FormatDuration(limits_.idle_timeout));
      }
    }
  }
}

}  // namespace verifyd
