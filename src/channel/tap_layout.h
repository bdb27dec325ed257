#pragma once
// Tap mode of a call channel (verify.proto, OpenChannelRequest.tap): the serving stack's own
// attention calls, copied after they ran by the tap kernel (kernels/tap/) on the stack's stream,
// then compared by verifyd off the stack's critical path. Nothing on the stack's stream waits
// for verifyd: a tap that finds the ring full drops the call and counts it.
//
// Memory (kernels/tap/tap_abi.h): the slots region holds a TapControl block and `slots` ring
// slots (q, the stack's o, the pages the call read); the channel's request area holds one record
// per slot (the call's number, batch, pages, flags, kv_indptr, kv_lens and tree mask).
//
// The ring: the tap kernel publishes fill n into slot n % slots and then stores n + 1 into the
// header's tap_produced (after a system-wide fence: the slot and record are whole). verifyd
// polls tap_produced, takes each fill in order (its record copied out first), checks it, serves
// it through the tap handler, then stores the fills it is done with into TapControl.consumed in
// the region (the tap kernel reads it there) and into the header's tap_consumed (tap_compared
// and tap_refused count how each ended). The tap kernel fills a slot only while
// produced - consumed < slots.
//
// Sampling: verifyd writes TapControl.sample_ppm (from --shadow_sample_rate, followed live); the
// tap kernel samples call n when TapSampled(n, sample_ppm).

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tap/tap_abi.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd::channel {

inline constexpr uint32_t kMaxTapSlots = 64;

struct TapPlan {
  v1::TapSpec spec;
  tap::TapSlotGeometry geometry;
  uint64_t region_bytes = 0;  // the control block and every slot
  bool shm_region = false;    // the slots region is shm (else cuda_ipc)
};

// Checks the spec (INVALID_ARGUMENT naming `tap.field`) and that its records fit a request area
// of `capacity` bytes.
absl::StatusOr<TapPlan> PlanTap(const v1::TapSpec& spec, uint64_t capacity);

// Slot `slot`'s fixed part as a call: q, kv_pool (the slot's pages) and o_out (the stack's output)
// as ranges of the slots region at their largest shapes, a shm or a cuda_ipc range by
// `shm_region`; mask_format, sm_scale and device from the spec.
v1::VerifyRequest TapSlotCall(const TapPlan& plan, uint32_t slot, bool shm_region);

// The call in a slot: `slot_call` (TapSlotCall) cut to the record's batch and pages, with
// kv_indptr, kv_lens and tree_mask inline from the record and kv_indices 0 .. pages - 1.
// `record`: the slot's record in the request area, which the client's GPU can write at any time:
// it is copied out once, first. `call_number`: the tap call's number in the record.
// INVALID_ARGUMENT naming the field: a record the tap kernel marked malformed, a batch outside 1
// to max_batch, pages outside 1 to max_pages, kv_indptr not starting at 0, decreasing or not
// ending at pages. The contents are checked afterwards as in any call (ValidateBundle).
absl::Status BuildTapCall(const TapPlan& plan, const v1::VerifyRequest& slot_call,
                          const char* record, v1::VerifyRequest* call, uint32_t* call_number);

// Whether `s` is a backend label: 1 to 32 characters of [a-z0-9_].
bool IsBackendLabel(const std::string& s);

}  // namespace verifyd::channel
