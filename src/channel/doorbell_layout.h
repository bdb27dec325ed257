#pragma once
// Doorbell mode of a call channel (verify.proto, OpenChannelRequest.descriptors): calls that a
// GPU stream makes with three stream memory operations, so that a CUDA graph can capture them.
//
// At open the client names each call's fixed part once, as a descriptor (a VerifyRequest whose
// tensors are region ranges at their largest shapes). The request area then holds layout slots:
// the dynamic part of a call, written by the client (a device-to-host copy on its stream):
//
//   int32 words: [0] batch (1 to max_batch), [1] generation,
//                [2, 3 + max_batch)            kv_indptr[0..max_batch] (the first batch+1 used)
//                [3 + max_batch, 3 + 2*max_batch) kv_lens[0..max_batch)  (the first batch used)
//
// The generation says when the layout changes. 0: verifyd reads (copies and checks) the page ids
// and mask that the call's descriptor names at every call. Otherwise the client writes a new
// generation whenever it writes the slot or the page ids or mask its calls name (once per
// forward pass), and verifyd reads them at the first call of a generation, on each of its lanes:
// later calls with the same slot, generation, kv_indptr, kv_lens and tensors read that checked
// copy (LayoutKey, BundleView::layout_key). A client that changes its page ids without a new
// generation is served the ones read before.
//
// One call, on the client's stream:
//   1. ring: write the header's doorbell word = kRung | slot << 16 | descriptor
//      (cuStreamWriteValue32, which fences the stream's earlier writes before it);
//   2. wait until the done word has bit kDone set (cuStreamWaitValue32, CU_STREAM_WAIT_VALUE_AND);
//   3. reset the done word to 0 (cuStreamWriteValue32).
// verifyd sees the doorbell word change (it polls: a GPU cannot wake a futex), stores 0 into it,
// builds the call from the descriptor and the slot (a copy of the slot: the client may write it
// again at any time), serves it as a Verify call whose output goes to o_out, writes the
// serialized VerifyResponse into the response area and its size into response_bytes, then
// stores kDone | code << 8 into the done word (code: the call's google.rpc code, 0 = OK). A
// failed call's o_out is zero-filled and counted in failed_calls, so the client's graph goes on.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd::channel {

inline constexpr uint32_t kRung = 0x80000000u;
inline constexpr uint32_t kDone = 1u;
inline constexpr uint32_t kMaxDescriptors = 4096;
inline constexpr uint32_t kMaxLayoutSlots = 256;
inline constexpr uint32_t kDefaultLayoutSlots = 2;

// A doorbell word: which descriptor and layout slot the call uses.
struct Ring {
  uint32_t descriptor = 0, slot = 0;
};
inline uint32_t RingWord(Ring r) {
  return kRung | (r.slot & 0x7fffu) << 16 | (r.descriptor & 0xffffu);
}
inline Ring DecodeRing(uint32_t word) { return Ring{word & 0xffffu, (word >> 16) & 0x7fffu}; }
inline uint32_t DoneWord(int code) { return kDone | (static_cast<uint32_t>(code) & 0xffu) << 8; }
// The layout key of a call from channel `channel` (a number no other open channel has) with
// layout slot `slot` (below kMaxLayoutSlots) of generation `generation`: 0 when the generation is.
inline uint64_t LayoutKey(uint32_t channel, uint32_t slot, uint32_t generation) {
  if (generation == 0) return 0;
  return uint64_t{channel & 0xffffffu} << 40 | uint64_t{slot & 0xffu} << 32 | generation;
}

// What every descriptor of a channel shares, checked at open.
struct DoorbellPlan {
  int64_t max_batch = 0;
  int64_t draft = 0;  // T
  uint32_t slots = 0;
  uint32_t slot_bytes = 0;  // a multiple of 64
};

// Checks the descriptors (INVALID_ARGUMENT naming `descriptors[i].field`) and that `slots`
// layout slots (0: kDefaultLayoutSlots) fit a request area of `capacity` bytes.
absl::StatusOr<DoorbellPlan> PlanDoorbell(
    const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& descriptors, uint32_t slots,
    uint64_t capacity);

// The call that `ring` asks for: descriptor `ring.descriptor` cut to the batch in its layout
// slot, with kv_indptr and kv_lens inline. `request_area`: the channel's request area, which the
// client can write at any time: the slot is copied out once, first. INVALID_ARGUMENT naming the
// field: an unknown descriptor or slot, a batch outside 1 to max_batch, or kv_indptr[batch]
// outside 1 to the descriptor's kv_indices. The contents are checked afterwards as in any call
// (ValidateBundle). `generation` (optional): the slot's generation, from the same copy.
absl::Status BuildDoorbellCall(
    const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& descriptors,
    const DoorbellPlan& plan, Ring ring, const char* request_area, v1::VerifyRequest* call,
    uint32_t* generation = nullptr);

}  // namespace verifyd::channel
