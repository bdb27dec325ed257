#pragma once
// Switch mode of a call channel (verify.proto, OpenChannelRequest.serving_switch): the control
// block of the switch between the stack's attention and the custom kernel inside the serving
// process (kernels/op/verify_op_api.h, VerifydSwitchBlock), at the channel's request_offset.
//
// Who writes which word:
//   verifyd (this file, every lease period / 4): magic, mode, canary_threshold, lease_period_us,
//     then lease_epoch + 1 (the renewal; stored last, with release order);
//   the stack's GPU (verifyd_switch_begin_step, once a step): steps, op_steps, lease_expired,
//     seen_epoch, seen_at_ns and last_step_ns.
// A step is the op's only while the epoch moved within the lease's period, by the GPU's own
// timer: verifyd killed, stopped or hung leaves the stack serving from the next step past it,
// with no host involved. Closing the channel hands the stack back at once (mode 0).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/op/verify_op_api.h"
#include "src/channel/channel_layout.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd::channel {

inline constexpr uint32_t kDefaultLeaseMs = 400;
inline constexpr uint32_t kMinLeaseMs = 20, kMaxLeaseMs = 60000;

// What the next steps serve (the block's mode word).
enum class SwitchPath : uint32_t { kStack = 0, kOp = 1, kCanary = 2 };
const char* SwitchPathName(SwitchPath p);

struct SwitchDirective {
  SwitchPath path = SwitchPath::kStack;
  double canary_fraction = 0;  // kCanary: the share of steps the op serves, [0, 1]
};

struct SwitchPlan {
  v1::SwitchSpec spec;
  uint32_t lease_ms = kDefaultLeaseMs;
  uint64_t block_offset = 0;  // in the channel's object: its request area
};

// Checks the spec (INVALID_ARGUMENT naming `serving_switch.field`; FAILED_PRECONDITION when its
// build is not `build`, verifyd's own) and that the block fits the request area.
absl::StatusOr<SwitchPlan> PlanSwitch(const v1::SwitchSpec& spec, absl::string_view build,
                                      const Geometry& geometry);

// One renewal: the directive and the lease's period, then the next epoch.
void RenewSwitch(char* block, const SwitchDirective& d, uint32_t lease_ms);
// The stack from the next step on, renewals or not.
void HandBackSwitch(char* block);

// What the GPU wrote.
struct SwitchCounts {
  uint64_t steps = 0, op_steps = 0, lease_expired = 0, seen_at_ns = 0, last_step_ns = 0;
};
SwitchCounts ReadSwitch(const char* block);

// Whether `s` is a model label: 1 to 64 characters of [a-z0-9_.-].
bool IsModelLabel(const std::string& s);

}  // namespace verifyd::channel
