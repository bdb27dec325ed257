#pragma once
// The custom kernel as a library the serving process loads (libverifyd_kernel.so): one verify-
// attention call on the caller's stream, with the contract of a bundle (q, the paged KV pool,
// kv_indptr / kv_indices / kv_lens, the tree mask in either format, sm_scale, o and lse). A call
// allocates nothing, never waits for the host and can be captured in a CUDA graph.
//
// Its device checks stay: the layout (kv_indptr rising from 0 within max_indices, each kv_len in
// [T, min(max_kv_len, its pages x page_size)]), the page ids (inside the pool), the mask (0/1
// bytes, no bits past T) and a finite output: o, and the lse of every row, which is finite since
// a row sees at least its own token (a NaN in a query leaves its row seeing nothing: o zeros, lse
// -inf); the op keeps an lse of its own when the caller wants none. By default (the environment's
// VERIFYD_OP_CHECKS unset or "kernel" when the op is made), where the plan is the shipped schedule
// (v5t, on sm_90), the kernel makes them as it reads: the page ids it reads, each request's layout
// before anything is read through it, and its rows of the mask; a call that fails may have
// written part of o and lse. Elsewhere, or with VERIFYD_OP_CHECKS=separate, two kernels of the
// op's own run around the kernel: the first checks every page id named, and a call that fails it
// writes nothing to o or lse (verifyd_op_checks_in_kernel says which an op does). Either way a
// failed call's `failed` byte (device memory) is 1, else 0, and its output is never to be served:
// the switch that holds the op runs the stack's own attention instead.
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
  uint32_t kv_dtype;  // 0: a bf16 pool; 1: e4m3 codes, each value e4m3 x kv_scale
  float kv_scale;     // an e4m3 pool's scale (finite, > 0); a bf16 pool's is 1
};

// One call: device pointers, contiguous, on the op's device.
struct VerifydOpCall {
  const void* q;              // bf16 [B*T, H, 576]
  const void* kv_pool;        // bf16 or e4m3 (kv_dtype) [pool_pages, page_size, 576]
  const int32_t* kv_indptr;   // [B + 1]
  const int32_t* kv_indices;  // [max_indices] (the first kv_indptr[B] are read)
  const int32_t* kv_lens;     // [B]: prefix + T
  const uint8_t* mask;        // see mask_bits
  void* o;                    // bf16 [B*T, H, 512] out
  float* lse;                 // fp32 [B*T, H] out when want_lse, else null
  uint8_t* failed;            // one byte out: 0 served, 1 a check failed (not to be served)
};

// The switch's control block: host memory the device reads (pinned, mapped), written by whoever
// controls the serving (verifyd, or the stack's own code), read once per step on the device by
// verifyd_switch_begin_step. A step is served by the op when `mode` says so and the lease holds;
// else by the stack's own attention.
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
VERIFYD_OP_EXPORT VerifydOp* verifyd_op_create(const VerifydOpGeometry* geometry, char* error,
                                               uint32_t error_bytes);
VERIFYD_OP_EXPORT void verifyd_op_destroy(VerifydOp* op);
// Enqueues one call on `stream` (a cudaStream_t). Returns the launches' cudaError_t (0: all
// enqueued); a null pointer or a want_lse mismatch is cudaErrorInvalidValue (1).
VERIFYD_OP_EXPORT int verifyd_op_attend(VerifydOp* op, const VerifydOpCall* call, void* stream);
// Device bytes the op holds (its split partials, its lse when the caller wants none, its check
// words).
VERIFYD_OP_EXPORT uint64_t verifyd_op_device_bytes(const VerifydOp* op);
// 1 where the op's checks run inside the kernel (the default on sm_90), 0 where they run in the
// op's own kernels around it (VERIFYD_OP_CHECKS=separate, or a plan other than v5t).
VERIFYD_OP_EXPORT uint32_t verifyd_op_checks_in_kernel(const VerifydOp* op);
// The switch (verify_switch.cu): in a captured step, one IF/ELSE conditional node a layer, so
// the path not taken launches nothing; where the driver has no conditional nodes (before CUDA
// 12.8), a kernel-side branch. Its calls, per captured step:
//   verifyd_switch_begin_step(sw, block, use_op, layer_failed, stream)     once, first
//   per layer, with conditional nodes:
//     verifyd_switch_layer_op(sw, layer, op, call, stream, &s)  the op's call (its body)
//       ... the stack's attention on s (the fallback: runs when the op's call failed)
//     verifyd_switch_layer_else(sw, &s)
//       ... the stack's attention on s (runs when the step is the stack's)
//     verifyd_switch_layer_end(sw)
//   per layer, without: the stack's attention on `stream`, then
//     verifyd_switch_layer_branch(sw, layer, op, call, o, lse, stream)
// Or a step as one IF/ELSE node (conditional nodes; instead of begin_step):
//   verifyd_switch_step_op(sw, block, use_op, layer_failed, stream, &s)
//     the stack's forward pass on s; in each layer:
//       verifyd_switch_layer_in_step(sw, layer, op, call, &f)
//         ... the stack's attention on f (the fallback: runs when the op's call failed)
//       verifyd_switch_fallback_end(sw)
//   verifyd_switch_step_stack(sw, &s)
//     the stack's forward pass on s, with the stack's attention in each layer
//   verifyd_switch_step_end(sw)
// Every layer of [0, layers) is to be in each captured step exactly once: a handle begin_step
// made for a layer without its node fails the graph's instantiation. Calls return 0 or a
// cudaError_t; verifyd_switch_error says what failed, naming the argument.
#define VERIFYD_SWITCH_MAX_LAYERS 1024u
typedef struct VerifydSwitch VerifydSwitch;

// 1 when the driver runs IF/ELSE conditional nodes (CUDA 12.8+).
VERIFYD_OP_EXPORT uint32_t verifyd_switch_conditional_nodes(void);
// A switch of `layers` layers (1 to VERIFYD_SWITCH_MAX_LAYERS) on the current device: its own
// stream, which captures the conditional bodies. `conditional`: 1, a capture's layers are
// conditional nodes (layer_op/else/end); 0, kernel-side branches (layer_branch). Null with a
// message when it cannot.
VERIFYD_OP_EXPORT VerifydSwitch* verifyd_switch_create(uint32_t layers, uint32_t conditional,
                                                       char* error, uint32_t error_bytes);
VERIFYD_OP_EXPORT void verifyd_switch_destroy(VerifydSwitch* sw);
VERIFYD_OP_EXPORT const char* verifyd_switch_error(const VerifydSwitch* sw);
// Enqueues the step's decision on `stream`: reads `block` (a device-visible pointer to the
// control block) and writes `use_op` (one device byte: 1 when the op serves this step) and each
// of the `layers` bytes of `layer_failed` (1 - use_op; a layer whose op call ran holds its
// verdict after it). A block without the magic, or a lease not renewed within its period, gives
// the stack. In a capture with conditional nodes it also makes the layers' handles and sets them.
VERIFYD_OP_EXPORT int verifyd_switch_begin_step(VerifydSwitch* sw, VerifydSwitchBlock* block,
                                                uint8_t* use_op, uint8_t* layer_failed,
                                                void* stream);
// Adds layer `layer`'s IF/ELSE node after `stream`'s work, captures the op's `call` into its
// then-body (its verdict goes to layer_failed[layer], whatever call->failed says), and leaves
// the switch's stream capturing the fallback body, returned in `fallback_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_layer_op(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                              const VerifydOpCall* call, void* stream,
                                              void** fallback_stream);
// Ends the fallback body and starts the else-body (the step is the stack's), on `else_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_layer_else(VerifydSwitch* sw, void** else_stream);
// Ends the else-body: the layer is done.
VERIFYD_OP_EXPORT int verifyd_switch_layer_end(VerifydSwitch* sw);
// The step's decision (as begin_step), its IF/ELSE node after `stream`'s work, and the op's step
// body capturing on `op_step_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_step_op(VerifydSwitch* sw, VerifydSwitchBlock* block,
                                             uint8_t* use_op, uint8_t* layer_failed, void* stream,
                                             void** op_step_stream);
// In the op's step: layer `layer`'s op call (its verdict to layer_failed[layer]) and its
// fallback's IF node; the fallback body capturing on `fallback_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_layer_in_step(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                                   const VerifydOpCall* call,
                                                   void** fallback_stream);
// Ends the layer's fallback body: the op's step goes on.
VERIFYD_OP_EXPORT int verifyd_switch_fallback_end(VerifydSwitch* sw);
// Ends the op's step body and starts the stack's, on `stack_step_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_step_stack(VerifydSwitch* sw, void** stack_step_stream);
// Ends the stack's step body (or a redo step's redo body): the step is done.
VERIFYD_OP_EXPORT int verifyd_switch_step_end(VerifydSwitch* sw);
// A redo step: as step_op, but its layers' op calls have no fallback of their own (no
// conditional node a layer). After the step's IF/ELSE node, one IF node redoes the whole step
// with the stack's attention when the op served it and any layer's call failed (its layers' bytes
// then all say the stack). The stack's forward pass must give the same results when run again
// from the step's inputs (it writes, it does not accumulate in place). Calls:
//   verifyd_switch_step_op_redo(sw, block, use_op, layer_failed, stream, &s)
//     the stack's forward pass on s; in each layer verifyd_switch_layer_in_redo_step(...)
//   verifyd_switch_step_stack(sw, &s)      the forward pass with the stack's attention
//   verifyd_switch_step_redo(sw, &s)       the same again: the redo body
//   verifyd_switch_step_end(sw)
VERIFYD_OP_EXPORT int verifyd_switch_step_op_redo(VerifydSwitch* sw, VerifydSwitchBlock* block,
                                                  uint8_t* use_op, uint8_t* layer_failed,
                                                  void* stream, void** op_step_stream);
// In a redo step's op body: layer `layer`'s op call, its verdict to layer_failed[layer].
VERIFYD_OP_EXPORT int verifyd_switch_layer_in_redo_step(VerifydSwitch* sw, uint32_t layer,
                                                        VerifydOp* op, const VerifydOpCall* call);
// Ends a redo step's stack body, adds the redo's decision and IF node after the step, and starts
// the redo body (the stack's forward pass again) on `redo_stream`.
VERIFYD_OP_EXPORT int verifyd_switch_step_redo(VerifydSwitch* sw, void** redo_stream);
// Ends whatever body is being captured, after the caller's code failed in it.
VERIFYD_OP_EXPORT void verifyd_switch_layer_abort(VerifydSwitch* sw);
// The kernel-side branch, after the stack's attention wrote `o` (and `lse`): the op's call,
// computing into call->o (and call->lse) when the step is the op's, then copying them to `o`
// (and `lse`) when it served and passed every check. Its verdict goes to layer_failed[layer].
VERIFYD_OP_EXPORT int verifyd_switch_layer_branch(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                                  const VerifydOpCall* call, void* o, float* lse,
                                                  void* stream);
// The build the kernel comes from (the commit), as verifyd reports its own.
VERIFYD_OP_EXPORT const char* verifyd_op_build(void);
VERIFYD_OP_EXPORT uint32_t verifyd_op_abi_version(void);

}  // extern "C"
