#include "src/transport/stream_limiter.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace verifyd {

StreamLimiter::StreamLimiter(StreamLimits limits) : limits_(limits) {
  if (limits_.idle_timeout > absl::ZeroDuration()) reaper_ = std::thread([this] { Reap(); });
}

StreamLimiter::~StreamLimiter() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

absl::Status StreamLimiter::Open(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  if (static_cast<int>(last_.size()) >= limits_.max_streams) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "streams: ", last_.size(),
        " streams are open, the most --grpc_max_streams=", limits_.max_streams,
        " allows (the rest of the threads serve unary calls); send on an open stream, close "
        "idle ones, or use unary calls or call channels"));
  }
  last_[ctx] = Clock::now();
  return absl::OkStatus();
}

void StreamLimiter::Touch(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  if (auto it = last_.find(ctx); it != last_.end()) it->second = Clock::now();
}

void StreamLimiter::Close(grpc::ServerContext* ctx) {
  absl::MutexLock l(&mu_);
  last_.erase(ctx);
}

int StreamLimiter::open() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(last_.size());
}

int64_t StreamLimiter::idle_cancelled() const {
  absl::MutexLock l(&mu_);
  return idle_cancelled_;
}

void StreamLimiter::Reap() {
  const auto timeout = absl::ToChronoNanoseconds(limits_.idle_timeout);
  const absl::Duration period =
      std::clamp(limits_.idle_timeout / 4, absl::Milliseconds(20), absl::Seconds(1));
  absl::MutexLock l(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
    const auto now = Clock::now();
    for (auto& [ctx, last] : last_) {
      if (now - last < timeout) continue;
      // Cancelled under the lock: Close() takes it too, so the context is still alive here.
      ctx->TryCancel();
      last = Clock::time_point::max() - timeout;  // cancelled once
      ++idle_cancelled_;
      spdlog::warn("a data-plane stream from {} sent nothing for {}; cancelled", ctx->peer(),
                   absl::FormatDuration(limits_.idle_timeout));
    }
  }
}

}  // namespace verifyd
