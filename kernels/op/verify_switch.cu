// The switch between the stack's attention and the op inside a captured step (verify_op_api.h).
//
// In a capture, each layer becomes one IF/ELSE conditional node of the captured graph:
//
//   DecideStep ──sets every layer's handle to use_op──┐
//   layer l:  IF use_op ─ then: CheckCall → custom → Deliver (sets fallback_l = failed)
//                         │       └─ IF fallback_l ─ then: the stack's attention
//                         └ else: the stack's attention
//
// so the path not taken launches nothing, and an op call that fails a check is followed by the
// stack's attention in the same layer. Or the whole step is one IF/ELSE node (step_op): the
// then-body is the stack's forward pass captured with the op's calls (each with its fallback),
// the else-body the same forward pass with the stack's attention; a step then pays for one
// conditional node, not one a layer. A redo step (step_op_redo) drops the nested IF a layer: its
// layers' calls only record their verdicts, and one IF node after the step runs the stack's
// forward pass again when the op served the step and any call failed:
//
//   DecideStep ─ IF use_op ─ then: the forward pass, each layer CheckCall → custom → Deliver
//                          └ else: the forward pass with the stack's attention
//   SetRedo (use_op and a layer failed) ─ IF redo ─ then: the forward pass with the stack's
//
// The bodies are captured on the switch's own streams
// (cudaStreamBeginCaptureToGraph); the caller runs the stack's attention on the stream each call
// returns. Without conditional nodes (a driver before CUDA 12.8) the layer is a kernel-side
// branch instead: the stack's attention always runs, then the op, gated on use_op, computes into
// its own buffers and copies them over the stack's output only when it served and passed.

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kernels/op/verify_op_api.h"
#include "kernels/op/verify_op_internal.h"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A step's draw for the canary: a 32-bit mix of the step number (splitmix64's finalizer).
__device__ __forceinline__ uint32_t StepDraw(uint64_t step) {
  uint64_t z = step + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

// The layers' IF/ELSE handles of one captured step, passed by value (a kernel parameter).
struct LayerHandles {
  uint32_t count;  // 0 outside a capture
  cudaGraphConditionalHandle h[VERIFYD_SWITCH_MAX_LAYERS];
};

// One block: thread 0 decides; every thread writes layer bytes and sets layer handles.
__global__ void __launch_bounds__(kThreads)
    DecideStep(VerifydSwitchBlock* b, uint8_t* use_op, uint8_t* layer_failed, uint32_t layers,
               const __grid_constant__ LayerHandles handles) {
  __shared__ uint8_t use;
  if (threadIdx.x == 0) {
    volatile VerifydSwitchBlock* v = b;
    const uint64_t now = GlobalTimerNs();
    bool op = false;
    if (v->magic == VERIFYD_SWITCH_MAGIC) {
      const uint64_t step = v->steps;
      const uint32_t mode = v->mode;
      op = mode == 1 || (mode == 2 && StepDraw(step) < v->canary_threshold);
      const uint64_t epoch = v->lease_epoch;
      if (epoch != v->seen_epoch) {
        v->seen_epoch = epoch;
        v->seen_at_ns = now;
      }
      const uint64_t period_ns = uint64_t{v->lease_period_us} * 1000;
      if (op && period_ns != 0 && now - v->seen_at_ns > period_ns) {
        op = false;
        v->lease_expired = v->lease_expired + 1;
      }
      v->steps = step + 1;
      if (op) v->op_steps = v->op_steps + 1;
      v->last_step_ns = now;
    }
    use = op ? 1 : 0;
    *use_op = use;
  }
  __syncthreads();
  for (uint32_t l = threadIdx.x; l < layers; l += kThreads) layer_failed[l] = 1 - use;
  for (uint32_t l = threadIdx.x; l < handles.count; l += kThreads) {
    cudaGraphSetConditional(handles.h[l], use);
  }
}

// After a redo step's IF/ELSE node: the step is redone by the stack (its layers all to the
// stack) when the op was to serve it and a layer's call failed; else the handle stays 0.
__global__ void __launch_bounds__(kThreads)
    SetRedo(const uint8_t* use_op, uint8_t* layer_failed, uint32_t layers,
            cudaGraphConditionalHandle redo) {
  int failed = 0;
  for (uint32_t l = threadIdx.x; l < layers; l += kThreads) failed |= layer_failed[l];
  const bool again = __syncthreads_or(failed) != 0 && *use_op != 0;
  if (again) {
    for (uint32_t l = threadIdx.x; l < layers; l += kThreads) layer_failed[l] = 1;
  }
  if (threadIdx.x == 0) cudaGraphSetConditional(redo, again ? 1u : 0u);
}

// kFallback, kElse: a layer's bodies (layer_op). kOpStep, kStackStep: the step's bodies
// (step_op), with kOpStepFallback while a layer's fallback in the op's step is captured, and
// kRedoStep, a redo step's third body (step_redo).
enum class Stage { kIdle, kFallback, kElse, kOpStep, kOpStepFallback, kStackStep, kRedoStep };

}  // namespace

struct VerifydSwitch {
  uint32_t layers = 0;
  bool conditional = false;  // a capture's layers are conditional nodes (else kernel-side branches)
  cudaStream_t body = nullptr;      // captures the conditional bodies, one at a time ...
  cudaStream_t fallback = nullptr;  // ... but a fallback inside the op's step
  uint8_t* use_op = nullptr;
  uint8_t* layer_failed = nullptr;
  // The capture begin_step saw, and its layers' handles.
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  LayerHandles handles{};
  std::vector<bool> layer_done;
  // The layer in progress.
  Stage stage = Stage::kIdle;
  cudaGraph_t else_graph = nullptr;
  // A redo step (step_op_redo): its layers' calls have no fallback of their own; the stack's
  // forward pass runs again after the step when one failed.
  bool redo = false;
  cudaStream_t step_stream = nullptr;  // the caller's capturing stream
  cudaGraphConditionalHandle redo_handle{};
  std::string error;
};

namespace {

int Fail(VerifydSwitch* sw, cudaError_t e, const std::string& why) {
  sw->error = why + (e != cudaSuccess ? std::string(": ") + cudaGetErrorString(e) : "");
  return e != cudaSuccess ? static_cast<int>(e) : static_cast<int>(cudaErrorInvalidValue);
}

// Ends `stream`'s capture, if any.
void EndCapture(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (stream != nullptr && cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream, &g);
  }
  cudaGetLastError();
}

// Ends the body streams' captures, if any, leaving the switch idle.
void EndBody(VerifydSwitch* sw) {
  EndCapture(sw->fallback);
  EndCapture(sw->body);
  sw->stage = Stage::kIdle;
  sw->redo = false;
}

// Adds a conditional IF node of `size` bodies (then, else) after what `stream` has enqueued in
// the graph it captures into, and makes the node the stream's next dependency.
cudaError_t AddIf(cudaStream_t stream, cudaGraphConditionalHandle h, unsigned size,
                  cudaGraph_t* bodies) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
  cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, nullptr, &n);
  if (e != cudaSuccess) return e;
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = h;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = size;
  cudaGraphNode_t node = nullptr;
  e = cudaGraphAddNode(&node, graph, deps, nullptr, n, &params);
  if (e != cudaSuccess) return e;
  for (unsigned i = 0; i < size; ++i) bodies[i] = params.conditional.phGraph_out[i];
  return cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                             cudaStreamSetCaptureDependencies);
}

// Whether `stream` is capturing, and into which capture and graph.
bool Capturing(cudaStream_t stream, unsigned long long* id, cudaGraph_t* graph) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamGetCaptureInfo(stream, &status, id, graph, nullptr, nullptr, nullptr) !=
      cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
}

// Starts capturing `stream` into `graph` (a conditional body).
cudaError_t BeginCapture(cudaStream_t stream, cudaGraph_t graph) {
  return cudaStreamBeginCaptureToGraph(stream, graph, nullptr, nullptr, 0,
                                       cudaStreamCaptureModeRelaxed);
}

// Ends the body capture on sw->body and starts capturing the stack's body (sw->else_graph).
cudaError_t CaptureElse(VerifydSwitch* sw) {
  cudaGraph_t ended = nullptr;
  const cudaError_t e = cudaStreamEndCapture(sw->body, &ended);
  return e == cudaSuccess ? BeginCapture(sw->body, sw->else_graph) : e;
}

// Ends the stack's body, the last of a layer (kElse) or of a step (kStackStep): `what` names the
// call and `before` the call that must come first.
int EndStackBody(VerifydSwitch* sw, Stage stage, const std::string& what, const char* before) {
  if (sw->stage != stage) {
    EndBody(sw);
    return Fail(sw, cudaSuccess, what + ": no " + before + " before it");
  }
  cudaGraph_t ended = nullptr;
  const cudaError_t e = cudaStreamEndCapture(sw->body, &ended);
  sw->stage = Stage::kIdle;
  return e == cudaSuccess ? 0 : Fail(sw, e, what + ": the stack's body");
}

// On sw->body, capturing into `graph`: layer `layer`'s op call, whose last check sets a new
// handle of `graph` to the call's verdict, and the IF node of that handle after it, whose body
// (the stack's attention, to be captured) comes back in `fallback_body`.
cudaError_t OpCallWithFallback(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                               const VerifydOpCall* call, cudaGraph_t graph,
                               cudaGraph_t* fallback_body) {
  verifyd::op::CallExtras x;
  x.set_fallback = true;
  cudaError_t e =
      cudaGraphConditionalHandleCreate(&x.fallback, graph, 0, cudaGraphCondAssignDefault);
  if (e != cudaSuccess) return e;
  VerifydOpCall c = *call;
  c.failed = sw->layer_failed + layer;
  e = verifyd::op::Attend(op, &c, x, sw->body);
  return e == cudaSuccess ? AddIf(sw->body, x.fallback, 1, fallback_body) : e;
}

}  // namespace

extern "C" {

uint32_t verifyd_switch_conditional_nodes(void) {
  int version = 0;
  return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12080 ? 1 : 0;
}

VerifydSwitch* verifyd_switch_create(uint32_t layers, uint32_t conditional, char* error,
                                     uint32_t error_bytes) {
  auto fail = [&](const std::string& why) -> VerifydSwitch* {
    if (error != nullptr && error_bytes > 0) std::snprintf(error, error_bytes, "%s", why.c_str());
    return nullptr;
  };
  if (layers < 1 || layers > VERIFYD_SWITCH_MAX_LAYERS) {
    return fail("layers: " + std::to_string(layers) + ", expected 1 to " +
                std::to_string(VERIFYD_SWITCH_MAX_LAYERS));
  }
  if (conditional != 0 && !verifyd_switch_conditional_nodes()) {
    return fail("conditional: the CUDA driver runs no IF/ELSE conditional nodes (CUDA 12.8+)");
  }
  auto sw = new VerifydSwitch;
  sw->layers = layers;
  sw->conditional = conditional != 0;
  sw->layer_done.assign(layers, false);
  cudaError_t e = cudaStreamCreateWithFlags(&sw->body, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&sw->fallback, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    if (sw->body != nullptr) cudaStreamDestroy(sw->body);
    delete sw;
    return fail(std::string("body stream: ") + cudaGetErrorString(e));
  }
  return sw;
}

void verifyd_switch_destroy(VerifydSwitch* sw) {
  if (sw == nullptr) return;
  EndBody(sw);
  cudaStreamDestroy(sw->fallback);
  cudaStreamDestroy(sw->body);
  delete sw;
}

const char* verifyd_switch_error(const VerifydSwitch* sw) {
  return sw == nullptr ? "switch: null" : sw->error.c_str();
}

int verifyd_switch_begin_step(VerifydSwitch* sw, VerifydSwitchBlock* block, uint8_t* use_op,
                              uint8_t* layer_failed, void* stream_ptr) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (block == nullptr || use_op == nullptr || layer_failed == nullptr) {
    return Fail(sw, cudaSuccess, "begin_step: block, use_op and layer_failed are required");
  }
  if (sw->stage != Stage::kIdle) {
    return Fail(sw, cudaSuccess, "begin_step: a layer's bodies are still being captured");
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  sw->use_op = use_op;
  sw->layer_failed = layer_failed;
  sw->handles.count = 0;
  sw->graph = nullptr;
  sw->capture_id = 0;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  if (sw->conditional && Capturing(stream, &id, &graph)) {
    for (uint32_t l = 0; l < sw->layers; ++l) {
      const cudaError_t e =
          cudaGraphConditionalHandleCreate(&sw->handles.h[l], graph, 0, cudaGraphCondAssignDefault);
      if (e != cudaSuccess)
        return Fail(sw, e, "begin_step: layer " + std::to_string(l) + "'s handle");
    }
    sw->handles.count = sw->layers;
    sw->graph = graph;
    sw->capture_id = id;
    sw->layer_done.assign(sw->layers, false);
  }
  DecideStep<<<1, kThreads, 0, stream>>>(block, use_op, layer_failed, sw->layers, sw->handles);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : Fail(sw, e, "begin_step: the decision's launch");
}

int verifyd_switch_layer_op(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                            const VerifydOpCall* call, void* stream_ptr, void** fallback_stream) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (op == nullptr || call == nullptr || fallback_stream == nullptr) {
    return Fail(sw, cudaSuccess, "layer_op: op, call and fallback_stream are required");
  }
  if (layer >= sw->layers) {
    return Fail(
        sw, cudaSuccess,
        "layer: " + std::to_string(layer) + " is outside [0, " + std::to_string(sw->layers) + ")");
  }
  if (sw->stage != Stage::kIdle) {
    return Fail(sw, cudaSuccess, "layer_op: the previous layer's bodies are not ended");
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  if (!Capturing(stream, &id, &graph) || id != sw->capture_id || sw->handles.count == 0) {
    return Fail(sw, cudaSuccess,
                "layer_op: the stream is not in the capture begin_step conditioned (call "
                "begin_step first in the same capture, with conditional nodes)");
  }
  if (sw->layer_done[layer]) {
    return Fail(sw, cudaSuccess, "layer: " + std::to_string(layer) + " is already in this step");
  }
  cudaGraph_t bodies[2] = {nullptr, nullptr};
  cudaError_t e = AddIf(stream, sw->handles.h[layer], 2, bodies);
  if (e != cudaSuccess) return Fail(sw, e, "layer_op: the layer's IF/ELSE node");
  sw->layer_done[layer] = true;
  sw->else_graph = bodies[1];
  // Then: the op, whose last check sets the fallback's handle, and the fallback's IF node.
  e = BeginCapture(sw->body, bodies[0]);
  if (e != cudaSuccess) return Fail(sw, e, "layer_op: the op's body");
  cudaGraph_t fallback_body = nullptr;
  e = OpCallWithFallback(sw, layer, op, call, bodies[0], &fallback_body);
  cudaGraph_t ended = nullptr;
  const cudaError_t end = cudaStreamEndCapture(sw->body, &ended);
  if (e == cudaSuccess) e = end;
  if (e == cudaSuccess) e = BeginCapture(sw->body, fallback_body);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "layer_op: the op's call in its body");
  }
  sw->stage = Stage::kFallback;
  *fallback_stream = sw->body;
  return 0;
}

int verifyd_switch_layer_else(VerifydSwitch* sw, void** else_stream) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (sw->stage != Stage::kFallback || else_stream == nullptr) {
    return Fail(sw, cudaSuccess, "layer_else: no layer_op before it");
  }
  const cudaError_t e = CaptureElse(sw);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "layer_else: the stack's body (the fallback's capture ended badly?)");
  }
  sw->stage = Stage::kElse;
  *else_stream = sw->body;
  return 0;
}

int verifyd_switch_layer_end(VerifydSwitch* sw) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  return EndStackBody(sw, Stage::kElse, "layer_end", "layer_else");
}

void verifyd_switch_layer_abort(VerifydSwitch* sw) {
  if (sw != nullptr) EndBody(sw);
}

}  // extern "C"

namespace {

// Layer `layer` of the op's step being captured: in range and not yet in this step (it is now),
// and the step's graph in `step_graph`; else the error, `what` naming the call.
int ClaimLayerInStep(VerifydSwitch* sw, uint32_t layer, const char* what, cudaGraph_t* step_graph) {
  if (layer >= sw->layers || sw->layer_done[layer]) {
    return Fail(sw, cudaSuccess,
                "layer: " + std::to_string(layer) +
                    (layer >= sw->layers ? " is outside [0, " + std::to_string(sw->layers) + ")"
                                         : " is already in this step"));
  }
  unsigned long long id = 0;
  if (!Capturing(sw->body, &id, step_graph)) {
    return Fail(sw, cudaSuccess, std::string(what) + ": the op's step is no longer being captured");
  }
  sw->layer_done[layer] = true;
  return 0;
}

int StepOp(VerifydSwitch* sw, VerifydSwitchBlock* block, uint8_t* use_op, uint8_t* layer_failed,
           void* stream_ptr, void** op_step_stream, bool redo) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (block == nullptr || use_op == nullptr || layer_failed == nullptr ||
      op_step_stream == nullptr) {
    return Fail(sw, cudaSuccess,
                "step_op: block, use_op, layer_failed and op_step_stream are required");
  }
  if (!sw->conditional) {
    return Fail(sw, cudaSuccess, "step_op: the switch was made without conditional nodes");
  }
  if (sw->stage != Stage::kIdle) {
    return Fail(sw, cudaSuccess, "step_op: a step or a layer is still being captured");
  }
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  if (!Capturing(stream, &id, &graph)) {
    return Fail(sw, cudaSuccess, "step_op: the stream is not capturing a graph");
  }
  sw->use_op = use_op;
  sw->layer_failed = layer_failed;
  sw->capture_id = id;
  sw->graph = graph;
  sw->layer_done.assign(sw->layers, false);
  // One handle, the step's: DecideStep sets it.
  cudaError_t e =
      cudaGraphConditionalHandleCreate(&sw->handles.h[0], graph, 0, cudaGraphCondAssignDefault);
  if (e != cudaSuccess) return Fail(sw, e, "step_op: the step's handle");
  if (redo) {
    e = cudaGraphConditionalHandleCreate(&sw->redo_handle, graph, 0, cudaGraphCondAssignDefault);
    if (e != cudaSuccess) return Fail(sw, e, "step_op: the redo's handle");
  }
  sw->redo = redo;
  sw->step_stream = stream;
  sw->handles.count = 1;
  DecideStep<<<1, kThreads, 0, stream>>>(block, use_op, layer_failed, sw->layers, sw->handles);
  sw->handles.count = 0;  // layer_op does not belong in a step of this kind
  e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(sw, e, "step_op: the decision's launch");
  cudaGraph_t bodies[2] = {nullptr, nullptr};
  e = AddIf(stream, sw->handles.h[0], 2, bodies);
  if (e != cudaSuccess) return Fail(sw, e, "step_op: the step's IF/ELSE node");
  sw->else_graph = bodies[1];
  e = BeginCapture(sw->body, bodies[0]);
  if (e != cudaSuccess) return Fail(sw, e, "step_op: the op's step body");
  sw->stage = Stage::kOpStep;
  *op_step_stream = sw->body;
  return 0;
}

}  // namespace

extern "C" {

int verifyd_switch_step_op(VerifydSwitch* sw, VerifydSwitchBlock* block, uint8_t* use_op,
                           uint8_t* layer_failed, void* stream_ptr, void** op_step_stream) {
  return StepOp(sw, block, use_op, layer_failed, stream_ptr, op_step_stream, false);
}

int verifyd_switch_step_op_redo(VerifydSwitch* sw, VerifydSwitchBlock* block, uint8_t* use_op,
                                uint8_t* layer_failed, void* stream_ptr, void** op_step_stream) {
  return StepOp(sw, block, use_op, layer_failed, stream_ptr, op_step_stream, true);
}

int verifyd_switch_layer_in_redo_step(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                      const VerifydOpCall* call) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (op == nullptr || call == nullptr) {
    return Fail(sw, cudaSuccess, "layer_in_redo_step: op and call are required");
  }
  if (sw->stage != Stage::kOpStep || !sw->redo) {
    return Fail(sw, cudaSuccess,
                "layer_in_redo_step: not inside a redo step's op body "
                "(step_op_redo)");
  }
  cudaGraph_t step_graph = nullptr;
  if (const int r = ClaimLayerInStep(sw, layer, "layer_in_redo_step", &step_graph); r != 0) {
    return r;
  }
  VerifydOpCall c = *call;
  c.failed = sw->layer_failed + layer;
  const cudaError_t e = verifyd::op::Attend(op, &c, verifyd::op::CallExtras{}, sw->body);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "layer_in_redo_step: the op's call");
  }
  return 0;
}

int verifyd_switch_layer_in_step(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                 const VerifydOpCall* call, void** fallback_stream) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (op == nullptr || call == nullptr || fallback_stream == nullptr) {
    return Fail(sw, cudaSuccess, "layer_in_step: op, call and fallback_stream are required");
  }
  if (sw->stage != Stage::kOpStep) {
    return Fail(sw, cudaSuccess, "layer_in_step: not inside the op's step (step_op)");
  }
  if (sw->redo) {
    return Fail(sw, cudaSuccess, "layer_in_step: a redo step's layers take layer_in_redo_step");
  }
  cudaGraph_t step_graph = nullptr;
  if (const int r = ClaimLayerInStep(sw, layer, "layer_in_step", &step_graph); r != 0) return r;
  cudaGraph_t fallback_body = nullptr;
  cudaError_t e = OpCallWithFallback(sw, layer, op, call, step_graph, &fallback_body);
  if (e == cudaSuccess) e = BeginCapture(sw->fallback, fallback_body);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "layer_in_step: the op's call and its fallback");
  }
  sw->stage = Stage::kOpStepFallback;
  *fallback_stream = sw->fallback;
  return 0;
}

int verifyd_switch_fallback_end(VerifydSwitch* sw) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (sw->stage != Stage::kOpStepFallback) {
    EndBody(sw);
    return Fail(sw, cudaSuccess, "fallback_end: no layer_in_step before it");
  }
  cudaGraph_t ended = nullptr;
  const cudaError_t e = cudaStreamEndCapture(sw->fallback, &ended);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "fallback_end: the layer's fallback body");
  }
  sw->stage = Stage::kOpStep;
  return 0;
}

int verifyd_switch_step_stack(VerifydSwitch* sw, void** stack_step_stream) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (sw->stage != Stage::kOpStep || stack_step_stream == nullptr) {
    EndBody(sw);
    return Fail(sw, cudaSuccess, "step_stack: no step_op before it (or a fallback not ended)");
  }
  const cudaError_t e = CaptureElse(sw);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "step_stack: the stack's step body (the op's step ended badly?)");
  }
  sw->stage = Stage::kStackStep;
  *stack_step_stream = sw->body;
  return 0;
}

int verifyd_switch_step_redo(VerifydSwitch* sw, void** redo_stream) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (sw->stage != Stage::kStackStep || !sw->redo || redo_stream == nullptr) {
    EndBody(sw);
    return Fail(sw, cudaSuccess,
                "step_redo: no step_stack of a redo step (step_op_redo) before it");
  }
  cudaGraph_t ended = nullptr;
  cudaError_t e = cudaStreamEndCapture(sw->body, &ended);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "step_redo: the stack's step body");
  }
  // After the IF/ELSE node, on the caller's stream: the redo's decision, then its IF node.
  SetRedo<<<1, kThreads, 0, sw->step_stream>>>(sw->use_op, sw->layer_failed, sw->layers,
                                               sw->redo_handle);
  e = cudaGetLastError();
  cudaGraph_t body = nullptr;
  if (e == cudaSuccess) e = AddIf(sw->step_stream, sw->redo_handle, 1, &body);
  if (e == cudaSuccess) e = BeginCapture(sw->body, body);
  if (e != cudaSuccess) {
    EndBody(sw);
    return Fail(sw, e, "step_redo: the redo's decision and IF node");
  }
  sw->stage = Stage::kRedoStep;
  *redo_stream = sw->body;
  return 0;
}

int verifyd_switch_step_end(VerifydSwitch* sw) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  const bool redo = sw->redo;
  sw->redo = false;
  return redo ? EndStackBody(sw, Stage::kRedoStep, "step_end", "step_redo")
              : EndStackBody(sw, Stage::kStackStep, "step_end", "step_stack");
}

int verifyd_switch_layer_branch(VerifydSwitch* sw, uint32_t layer, VerifydOp* op,
                                const VerifydOpCall* call, void* o, float* lse, void* stream_ptr) {
  if (sw == nullptr) return cudaErrorInvalidValue;
  if (op == nullptr || call == nullptr || o == nullptr || sw->use_op == nullptr) {
    return Fail(sw, cudaSuccess, "layer_branch: op, call, o and a begin_step are required");
  }
  if (layer >= sw->layers) {
    return Fail(
        sw, cudaSuccess,
        "layer: " + std::to_string(layer) + " is outside [0, " + std::to_string(sw->layers) + ")");
  }
  if ((call->lse != nullptr) != (lse != nullptr)) {
    return Fail(sw, cudaSuccess, "lse: pass both the op's and the layer's, or neither");
  }
  VerifydOpCall c = *call;
  c.failed = sw->layer_failed + layer;
  verifyd::op::CallExtras x;
  x.serve = sw->use_op;
  x.copy_o = o;
  x.copy_lse = lse;
  const cudaError_t e = verifyd::op::Attend(op, &c, x, static_cast<cudaStream_t>(stream_ptr));
  return e == cudaSuccess ? 0 : Fail(sw, e, "layer_branch: the op's launches");
}

}  // extern "C"
