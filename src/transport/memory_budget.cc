#include "src/transport/memory_budget.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

std::string MiB(int64_t bytes) {
  return absl::StrCat(static_cast<double>(bytes) / (1 << 20), " MiB");
}

}  // namespace

MemoryBudget::Admission& MemoryBudget::Admission::operator=(Admission&& o) noexcept {
  if (this != &o) {
    Release();
    budget_ = o.budget_;
    bytes_ = o.bytes_;
    peer_ = std::move(o.peer_);
    o.budget_ = nullptr;
  }
  return *this;
}

void MemoryBudget::Admission::Release() {
  if (!budget_) return;
  MemoryBudget* b = budget_;
  budget_ = nullptr;
  b->GiveBack(bytes_, peer_);
}

void MemoryBudget::Admission::ShrinkTo(int64_t bytes) {
  if (!budget_ || bytes >= bytes_) return;
  const int64_t excess = bytes_ - std::max<int64_t>(bytes, 0);
  bytes_ -= excess;
  budget_->GiveBack(excess, peer_);
}

void MemoryBudget::GiveBack(int64_t bytes, const std::string& peer) {
  if (bytes == 0) return;
  int64_t peak = 0;
  {
    absl::MutexLock l(&mu_);
    in_flight_ -= bytes;
    if (!peer.empty()) {
      auto it = by_peer_.find(peer);
      if (it != by_peer_.end() && (it->second -= bytes) <= 0) by_peer_.erase(it);
    }
    if (in_flight_ != 0) return;
    peak = std::exchange(peak_, 0);
  }
  if (on_idle_) on_idle_(peak);
}

absl::StatusOr<MemoryBudget::Admission> MemoryBudget::Admit(int64_t bytes,
                                                            const std::string& peer) {
  absl::MutexLock l(&mu_);
  if (limit_ > 0 && bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat("request of ", MiB(bytes),
                                                     " exceeds the memory budget of ", MiB(limit_),
                                                     " (", flag_, ")"));
  }
  if (limit_ > 0 && in_flight_ + bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request of ", MiB(bytes), " does not fit the memory budget now: ", MiB(in_flight_), " of ",
        MiB(limit_), " held by requests in flight (", flag_, ")"));
  }
  if (limit_ > 0 && !peer.empty() && peer_limit_ < limit_) {
    const auto it = by_peer_.find(peer);
    const int64_t held = it == by_peer_.end() ? 0 : it->second;
    if (bytes > peer_limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request of ", MiB(bytes), " exceeds one peer's share of the memory budget, ",
          MiB(peer_limit_), " (", flag_, " x --max_inflight_peer_share)"));
    }
    if (held + bytes > peer_limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request of ", MiB(bytes), " does not fit ", peer,
          "'s share of the memory budget now: ", MiB(held), " of its ", MiB(peer_limit_),
          " held by its requests in flight (", flag_, " x --max_inflight_peer_share)"));
    }
  }
  in_flight_ += bytes;
  peak_ = std::max(peak_, in_flight_);
  if (!peer.empty()) by_peer_[peer] += bytes;
  return Admission(this, bytes, peer);
}

int64_t MemoryBudget::in_flight() const {
  absl::MutexLock l(&mu_);
  return in_flight_;
}

}  // namespace verifyd
