#include "src/channel/switch_control.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"

namespace verifyd::channel {
namespace {

template <typename T>
T* Field(char* block, size_t offset) {
  return reinterpret_cast<T*>(block + offset);
}

template <typename T>
void Store(char* block, size_t offset, T v) {
  __atomic_store_n(Field<T>(block, offset), v, __ATOMIC_RELAXED);
}

template <typename T>
T Load(const char* block, size_t offset) {
  return __atomic_load_n(reinterpret_cast<const T*>(block + offset), __ATOMIC_RELAXED);
}

}  // namespace

const char* SwitchPathName(SwitchPath p) {
  switch (p) {
    case SwitchPath::kStack:
      return "stack";
    case SwitchPath::kOp:
      return "op";
    case SwitchPath::kCanary:
      return "canary";
  }
  return "unknown";
}

bool IsModelLabel(const std::string& s) {
  return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
  });
}

absl::StatusOr<SwitchPlan> PlanSwitch(const v1::SwitchSpec& spec, absl::string_view build,
                                      const Geometry& geometry) {
  if (spec.layers() < 1 || spec.layers() > VERIFYD_SWITCH_MAX_LAYERS) {
    return absl::InvalidArgumentError(absl::StrCat("serving_switch.layers: ", spec.layers(),
                                                   ", expected 1 to ", VERIFYD_SWITCH_MAX_LAYERS));
  }
  if (!IsModelLabel(spec.model())) {
    return absl::InvalidArgumentError(absl::StrCat("serving_switch.model: '", spec.model(),
                                                   "' is not 1 to 64 characters of [a-z0-9_.-]"));
  }
  const uint32_t lease_ms = spec.lease_ms() == 0 ? kDefaultLeaseMs : spec.lease_ms();
  if (lease_ms < kMinLeaseMs || lease_ms > kMaxLeaseMs) {
    return absl::InvalidArgumentError(absl::StrCat("serving_switch.lease_ms: ", spec.lease_ms(),
                                                   ", expected 0 (", kDefaultLeaseMs, ") or ",
                                                   kMinLeaseMs, " to ", kMaxLeaseMs));
  }
  if (spec.build() != build) {
    return absl::FailedPreconditionError(absl::StrCat(
        "serving_switch.build: the kernel library is build '", spec.build(), "', verifyd is '",
        build,
        "': the gate and the flip judged verifyd's kernel, so the library must come from the "
        "same build (install the libverifyd_kernel.so of this verifyd)"));
  }
  if (geometry.capacity < sizeof(VerifydSwitchBlock)) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: the request area holds ", geometry.capacity,
                     " bytes, the switch's block needs ", sizeof(VerifydSwitchBlock)));
  }
  SwitchPlan plan;
  plan.spec = spec;
  plan.lease_ms = lease_ms;
  plan.block_offset = geometry.request_offset;
  return plan;
}

void RenewSwitch(char* block, const SwitchDirective& d, uint32_t lease_ms) {
  const double f = std::clamp(d.canary_fraction, 0.0, 1.0);
  const auto threshold = static_cast<uint32_t>(std::min(std::ldexp(f, 32), 4294967295.0));
  Store<uint32_t>(block, offsetof(VerifydSwitchBlock, magic), VERIFYD_SWITCH_MAGIC);
  Store<uint32_t>(block, offsetof(VerifydSwitchBlock, mode), static_cast<uint32_t>(d.path));
  Store<uint32_t>(block, offsetof(VerifydSwitchBlock, canary_threshold), threshold);
  Store<uint32_t>(block, offsetof(VerifydSwitchBlock, lease_period_us), lease_ms * 1000u);
  auto* epoch = Field<uint64_t>(block, offsetof(VerifydSwitchBlock, lease_epoch));
  __atomic_store_n(epoch, __atomic_load_n(epoch, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

void HandBackSwitch(char* block) {
  Store<uint32_t>(block, offsetof(VerifydSwitchBlock, mode),
                  static_cast<uint32_t>(SwitchPath::kStack));
}

SwitchCounts ReadSwitch(const char* block) {
  SwitchCounts c;
  c.steps = Load<uint64_t>(block, offsetof(VerifydSwitchBlock, steps));
  c.op_steps = Load<uint64_t>(block, offsetof(VerifydSwitchBlock, op_steps));
  c.lease_expired = Load<uint64_t>(block, offsetof(VerifydSwitchBlock, lease_expired));
  c.seen_at_ns = Load<uint64_t>(block, offsetof(VerifydSwitchBlock, seen_at_ns));
  c.last_step_ns = Load<uint64_t>(block, offsetof(VerifydSwitchBlock, last_step_ns));
  return c;
}

}  // namespace verifyd::channel
