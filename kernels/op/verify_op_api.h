#pragma once
// The custom kernel as a library the serving process loads (libverifyd_kernel.so): one verify-
// attention call on the caller's stream, with the contract of a bundle (q, the paged KV pool,
// kv_indptr / kv_indices / kv_lens, the tree mask in either format, sm_scale, o and lse). A call
// allocates nothing, never waits for the host and can be captured in a CUDA graph.
//
// Its device checks stay: before the kernel, the layout (kv_indptr rising from 0 within
// max_indices, each kv_len in [T, min(max_kv_len, its pages x page_size)]), every page id named
// (inside the pool) and the mask (0/1 bytes, no bits past T); after it, a finite output: o, and
// the lse of every row, which is finite since a row sees at least its own token (a NaN in a query
// leaves its row seeing nothing: o zeros, lse -inf); the op keeps an lse of its own when the
// caller wants none. A call
// that fails a check before the kernel writes nothing to o or lse; one whose output is not finite
// leaves it there. Either way its `failed` byte (device memory) is 1, else 0, and the output of a
// failed call is never to be served: the switch that holds the op runs the stack's own attention
// instead.
//
// clients/python/verifyd_client/kernel_op.py binds it with ctypes and mirrors the structs; it
// checks verifyd_op_abi_version().

#include <stdint.h>

// The library exports these alone (it is built with hidden visibility).
#define VERIFYD_OP_EXPORT __attribute__((visibility("default")))

extern "C" {

// Fixed when the op is made: one captured graph serves one batch size.
struct VerifydOpGeometry {
  uint32_t batch;        // B
  uint32_t draft;        // T
  uint32_t heads;        // H
  uint32_t page_size;    // tokens per page, a power of two in [1, 128]
  uint64_t pool_pages;   // pages in the KV pool
  uint64_t max_indices;  // kv_indices' length: kv_indptr[B] may not exceed it
  uint64_t max_kv_len;   // the longest prefix + T of any call (plans the KV split)
  uint32_t mask_bits;    // 0: uint8 [B, T, T] of 0/1; 1: bit-packed [B, T, ceil(T/8)]
  uint32_t want_lse;     // 1: calls write lse
  float sm_scale;
};

// One call: device pointers, contiguous, on the op's device.
struct VerifydOpCall {
  const void* q;              // bf16 [B*T, H, 576]
  const void* kv_pool;        // bf16 [pool_pages, page_size, 576]
  const int32_t* kv_indptr;   // [B + 1]
  const int32_t* kv_indices;  // [max_indices] (the first kv_indptr[B] are read)
  const int32_t* kv_lens;     // [B]: prefix + T
  const uint8_t* mask;        // see mask_bits
  void* o;                    // bf16 [B*T, H, 512] out
  float* lse;                 // fp32 [B*T, H] out when want_lse, else null
  uint8_t* failed;            // one byte out: 0 served, 1 a check failed (nothing written)
};

// The switch's control block: host memory the device reads (pinned, mapped), written by whoever
// controls the serving (verifyd, or the stack's own code), read once per step on the device by
// verifyd_switch_decide. A step is served by the op when `mode` says so and the lease holds; else
// by the stack's own attention.
struct VerifydSwitchBlock {
  uint32_t magic;             // kVerifydSwitchMagic once set up
  uint32_t mode;              // 0: the stack serves, 1: the op serves, 2: canary
  uint32_t canary_threshold;  // canary: a step's draw (uniform in [0, 2^32)) below it takes the op
  uint32_t lease_period_us;   // 0: no lease; else the op serves only while renewals come
  uint64_t lease_epoch;       // the controller adds one at each renewal
  // Written by the device, read by the controller:
  uint64_t steps;          // steps decided
  uint64_t op_steps;       // of those, served by the op
  uint64_t lease_expired;  // steps the op would have served but for an expired lease
  uint64_t seen_epoch;     // the last lease_epoch the device saw ...
  uint64_t seen_at_ns;     // ... and when (the GPU's global timer)
  uint64_t last_step_ns;   // the global timer at the last step
};
#define VERIFYD_SWITCH_MAGIC 0x56445357u  // "WSDV"

typedef struct VerifydOp VerifydOp;

// Checks the geometry and allocates the op's device memory on the current device. Null when it
// cannot, with a message naming the field in `error` (`error_bytes` of room).
VERIFYD_OP_EXPORT VerifydOp* verifyd_op_create(const VerifydOpGeometry* geometry, char* error, uint32_t error_bytes);
VERIFYD_OP_EXPORT void verifyd_op_destroy(VerifydOp* op);
// Enqueues one call on `stream` (a cudaStream_t). Returns the launches' cudaError_t (0: all
// enqueued); a null pointer or a want_lse mismatch is cudaErrorInvalidValue (1).
VERIFYD_OP_EXPORT int verifyd_op_attend(VerifydOp* op, const VerifydOpCall* call, void* stream);
// Device bytes the op holds (its split partials, its lse when the caller wants none, its check
// words).
VERIFYD_OP_EXPORT uint64_t verifyd_op_device_bytes(const VerifydOp* op);
// Enqueues one step's decision on `stream`: reads `block` (a device-visible pointer to the
// control block) and writes `use_op` (one byte of device memory: 1 when the op serves this step)
// and every one of `layers` bytes of `layer_failed` (1 - use_op: the stack's attention runs in a
// layer whose byte is 1; the op's call in that layer overwrites it with its own verdict). A block
// without the magic, or a lease not renewed within its period, gives the stack. Returns the
// launch's cudaError_t.
VERIFYD_OP_EXPORT int verifyd_switch_decide(VerifydSwitchBlock* block, uint8_t* use_op,
                                            uint8_t* layer_failed, uint32_t layers, void* stream);
// The build the kernel comes from (the commit), as verifyd reports its own.
VERIFYD_OP_EXPORT const char* verifyd_op_build(void);
VERIFYD_OP_EXPORT uint32_t verifyd_op_abi_version(void);

}  // extern "C"
