#include "src/transport/memory_budget.h"

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
    o.budget_ = nullptr;
  }
  return *this;
}

void MemoryBudget::Admission::Release() {
  if (!budget_) return;
  absl::MutexLock l(&budget_->mu_);
  budget_->in_flight_ -= bytes_;
  budget_ = nullptr;
}

absl::StatusOr<MemoryBudget::Admission> MemoryBudget::Admit(int64_t bytes) {
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
  in_flight_ += bytes;
  return Admission(this, bytes);
}

int64_t MemoryBudget::in_flight() const {
  absl::MutexLock l(&mu_);
  return in_flight_;
}

}  // namespace verifyd
