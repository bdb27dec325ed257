// libverifyd_kernel.so (verify_op_api.h): the custom kernel and its device checks. By default
// (VERIFYD_OP_CHECKS unset or "kernel"), where the plan is the shipped schedule (v5t, on sm_90),
// the kernel and its split combine make the checks themselves (CustomCallChecks,
// kernels/custom/kernel_checks.cuh): one launch, or two with a split. Otherwise (another plan, or
// VERIFYD_OP_CHECKS=separate) the kernel runs between two small kernels of the op's own: before
// it, CheckCall looks at the layout, every page id named and the mask and ORs what it finds into
// the op's verdict word; the custom kernel reads the verdict and writes nothing when it is set.
// After it, Deliver checks the output for NaN and Inf, and its last block turns the verdict into
// the call's `failed` byte and clears it for the next call.
// Nothing comes back to the host: the switch reads `failed` on the device (verify_switch.cu).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/call_checks.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/op/verify_op_api.h"
#include "kernels/op/verify_op_internal.h"
#include "kernels/verify_problem.h"

#if __has_include("verifyd_commit.h")  // the build's commit (scripts/commit_stamp.cmake)
#include "verifyd_commit.h"
#endif
#ifndef VERIFYD_GIT_COMMIT
#define VERIFYD_GIT_COMMIT "unknown"
#endif

namespace {

using verifyd::kernels::CustomConfig;
using verifyd::kernels::MaskFormat;
using verifyd::kernels::NonFiniteBf16Pair;
using verifyd::kernels::VerifyProblem;

constexpr uint32_t kAbiVersion = 4;
constexpr int kThreads = 256;

// Verdict bits: why a call's output is not to be served (defined with the kernels' own checks).
constexpr unsigned kLayoutBad = verifyd::kernels::kVerdictLayoutBad;
constexpr unsigned kIndexBad = verifyd::kernels::kVerdictIndexBad;
constexpr unsigned kMaskBad = verifyd::kernels::kVerdictMaskBad;
constexpr unsigned kNonFinite = verifyd::kernels::kVerdictNonFinite;
constexpr unsigned kNotServing = verifyd::kernels::kVerdictNotServing;

struct CheckArgs {
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_lens;
  const uint8_t* mask;
  const uint8_t* serve;  // null: always
  int64_t max_indices, max_kv_len, mask_bytes;
  uint32_t page_limit;  // PageIdLimit of the pool
  int batch, draft, page_size, mask_bits, mask_row_bytes;
  unsigned* verdict;
};

__global__ void __launch_bounds__(kThreads) CheckCall(const CheckArgs a) {
  unsigned bad = 0;
  if (a.serve != nullptr && *a.serve == 0) {
    // Not this call's step: one bit stops the kernel, and nothing else needs looking at.
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(a.verdict, kNotServing);
    return;
  }
  if (blockIdx.x == 0) {
    for (int b = threadIdx.x; b < a.batch; b += kThreads) {
      if (verifyd::kernels::RequestLayoutBad(b, a.kv_indptr[b], a.kv_indptr[b + 1], a.kv_lens[b],
                                             a.max_indices, a.draft, a.max_kv_len, a.page_size)) {
        bad |= kLayoutBad;
      }
    }
  }
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  int64_t named = a.kv_indptr[a.batch];
  named = named < 0 ? 0 : (named > a.max_indices ? a.max_indices : named);
  for (int64_t i = first; i < named; i += stride) {
    if (verifyd::kernels::PageIdBad(a.kv_indices[i], a.page_limit)) bad |= kIndexBad;
  }
  for (int64_t i = first; i < a.mask_bytes; i += stride) {
    if (verifyd::kernels::MaskByteBad(a.mask[i], a.mask_bits != 0, a.draft,
                                      i % a.mask_row_bytes == a.mask_row_bytes - 1)) {
      bad |= kMaskBad;
    }
  }
  bad = __reduce_or_sync(0xffffffffu, bad);
  if (bad != 0 && (threadIdx.x & 31) == 0) atomicOr(a.verdict, bad);
}

struct DeliverArgs {
  const uint4* o;  // 8 bf16 each
  int64_t o_vectors;
  const float* lse;
  int64_t lse_n;
  unsigned* words;  // [0] the verdict, [1] blocks done
  uint8_t* failed;
  bool set_fallback;  // also set `fallback` to the call's failed byte
  cudaGraphConditionalHandle fallback;
};

__global__ void __launch_bounds__(kThreads) Deliver(const DeliverArgs a) {
  unsigned* verdict = a.words;
  unsigned* done = a.words + 1;
  unsigned bad = 0;
  // A call the checks stopped wrote nothing: there is nothing to look at.
  if (*reinterpret_cast<volatile unsigned*>(verdict) == 0) {
    const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
    const int64_t stride = int64_t{gridDim.x} * kThreads;
    for (int64_t i = first; i < a.o_vectors; i += stride) {
      const uint4 v = a.o[i];
      if (NonFiniteBf16Pair(v.x) || NonFiniteBf16Pair(v.y) || NonFiniteBf16Pair(v.z) ||
          NonFiniteBf16Pair(v.w)) {
        bad = kNonFinite;
      }
    }
    // Every row sees at least its own draft token, so its lse is finite; -inf says it saw no
    // key at all, which is what a NaN in its query makes of it (and o is then zeros).
    for (int64_t i = first; i < a.lse_n; i += stride) {
      if (!isfinite(a.lse[i])) bad = kNonFinite;
    }
  }
  bad = __reduce_or_sync(0xffffffffu, bad);
  if (bad != 0 && (threadIdx.x & 31) == 0) atomicOr(verdict, bad);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      // The last block: every block's finding is in the verdict.
      const unsigned v = atomicExch(verdict, 0u);
      *a.failed = v != 0 ? 1 : 0;
      if (a.set_fallback) cudaGraphSetConditional(a.fallback, v != 0 ? 1u : 0u);
      atomicExch(done, 0u);
    }
  }
}

// A layer's fallback handle from the call's failed byte (the checks inside the kernel).
__global__ void SetFallback(const uint8_t* failed, cudaGraphConditionalHandle fallback) {
  if (threadIdx.x == 0) cudaGraphSetConditional(fallback, *failed != 0 ? 1u : 0u);
}

// The served call's output where the caller reads it, when it served and passed every check.
__global__ void __launch_bounds__(kThreads)
    CopyServed(const uint8_t* failed, const uint4* o, uint4* to, int64_t o_vectors,
               const float* lse, float* lse_to, int64_t lse_n) {
  if (*failed != 0) return;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t i = first; i < o_vectors; i += stride) to[i] = o[i];
  if (lse_to != nullptr) {
    for (int64_t i = first; i < lse_n; i += stride) lse_to[i] = lse[i];
  }
}

int Blocks(int64_t work, int cap) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace

struct VerifydOp {
  VerifydOpGeometry g{};
  VerifyProblem problem;       // the geometry; each call fills in the pointers
  CustomConfig config;         // skip = words, unless the kernel checks
  bool kernel_checks = false;  // the kernel and its combine make the checks (CustomCallChecks)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  float* lse = nullptr;       // the kernel's lse when the caller wants none: the check reads it
  unsigned* words = nullptr;  // the verdict and the blocks-done count
  int check_blocks = 1, deliver_blocks = 1;
  int64_t mask_bytes = 0, o_vectors = 0, lse_n = 0;
};

extern "C" {

VerifydOp* verifyd_op_create(const VerifydOpGeometry* geometry, char* error, uint32_t error_bytes) {
  auto fail = [&](const std::string& why) -> VerifydOp* {
    if (error != nullptr && error_bytes > 0) std::snprintf(error, error_bytes, "%s", why.c_str());
    return nullptr;
  };
  if (geometry == nullptr) return fail("geometry: null");
  const VerifydOpGeometry& g = *geometry;
  auto op = new VerifydOp;
  op->g = g;
  VerifyProblem& p = op->problem;
  p.shape.batch = static_cast<int>(g.batch);
  p.shape.draft = static_cast<int>(g.draft);
  p.shape.heads = static_cast<int>(g.heads);
  p.shape.page_size = static_cast<int>(g.page_size);
  p.shape.num_pages = static_cast<int64_t>(g.pool_pages);
  p.shape.num_indices = static_cast<int64_t>(g.max_indices);
  p.shape.mask_format = g.mask_bits ? MaskFormat::kBits : MaskFormat::kBytes;
  p.sm_scale = g.sm_scale;
  // An e4m3 pool goes to the kernel that reads its codes (v3e, kAuto's choice for it), with the
  // checks around it.
  p.shape.kv_dtype =
      g.kv_dtype == 1 ? verifyd::kernels::KvDtype::kE4m3 : verifyd::kernels::KvDtype::kBf16;
  p.kv_scale = g.kv_scale;
  p.max_kv_len = static_cast<int64_t>(g.max_kv_len);
  p.total_kv_len = p.max_kv_len * g.batch;
  std::string why = verifyd::kernels::CheckShape(p.shape);
  if (why.empty() &&
      (g.batch > 1u << 20 || g.draft > 1u << 20 || g.heads > 1u << 20 || g.page_size > 1u << 20)) {
    why = "geometry: a size past 2^20";
  }
  if (why.empty() && g.mask_bits > 1) why = "mask_bits: must be 0 or 1";
  if (why.empty() && g.kv_dtype > 1) why = "kv_dtype: must be 0 (bf16) or 1 (e4m3)";
  if (why.empty() && g.kv_dtype == 1 && !(std::isfinite(g.kv_scale) && g.kv_scale > 0)) {
    why = "kv_scale: an e4m3 pool's must be finite and > 0";
  }
  if (why.empty() && g.kv_dtype == 0 && g.kv_scale != 1.f) why = "kv_scale: a bf16 pool's is 1";
  if (why.empty() &&
      (g.max_kv_len < g.draft || g.max_kv_len > uint64_t(verifyd::kernels::kMaxPrefix) + g.draft)) {
    why = "max_kv_len: " + std::to_string(g.max_kv_len) + " is outside [draft, " +
          std::to_string(verifyd::kernels::kMaxPrefix) + " + draft]";
  }
  if (why.empty() && !(std::isfinite(g.sm_scale) && g.sm_scale > 0)) {
    why = "sm_scale: must be finite and > 0";
  }
  // Where the checks run: "kernel" (the default: inside the shipped schedule's kernels where the
  // plan is v5t, else separate) or "separate".
  const char* checks = std::getenv("VERIFYD_OP_CHECKS");
  const bool kernel_checks = checks == nullptr || std::strcmp(checks, "kernel") == 0;
  if (why.empty() && checks != nullptr && !kernel_checks && std::strcmp(checks, "separate") != 0) {
    why = std::string("VERIFYD_OP_CHECKS: '") + checks + "' is neither kernel nor separate";
  }
  if (!why.empty()) {
    delete op;
    return fail(why);
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int cap = 2 * (sms > 0 ? sms : 1);
  op->mask_bytes =
      int64_t{g.batch} * g.draft * verifyd::kernels::MaskRowBytes(p.shape.mask_format, g.draft);
  op->o_vectors = int64_t{g.batch} * g.draft * g.heads * verifyd::kernels::kHeadDimV / 8;
  op->lse_n = int64_t{g.batch} * g.draft * g.heads;
  op->check_blocks = Blocks(static_cast<int64_t>(g.max_indices) > op->mask_bytes
                                ? static_cast<int64_t>(g.max_indices)
                                : op->mask_bytes,
                            cap);
  op->deliver_blocks = Blocks(op->o_vectors, cap);
  verifyd::kernels::CustomPlan plan;
  cudaError_t e = verifyd::kernels::ResolveCustomPlan(p, op->config, &plan);
  if (e == cudaErrorNotSupported && g.kv_dtype == 1) {
    delete op;
    return fail("kv_dtype: e4m3 pools need a device the kernel that reads e4m3 runs on (sm_90)");
  }
  op->workspace_bytes = plan.workspace_bytes;
  if (e == cudaSuccess) e = cudaMalloc(&op->words, 2 * sizeof(unsigned));
  if (e == cudaSuccess && op->workspace_bytes > 0) {
    e = cudaMalloc(&op->workspace, op->workspace_bytes);
  }
  if (e == cudaSuccess && !g.want_lse) e = cudaMalloc(&op->lse, op->lse_n * sizeof(float));
  if (e == cudaSuccess) e = cudaMemset(op->words, 0, 2 * sizeof(unsigned));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    verifyd_op_destroy(op);
    return fail(std::string("device memory: ") + cudaGetErrorString(e));
  }
  op->kernel_checks = kernel_checks && verifyd::kernels::CustomChecksInKernel(p, op->config);
  if (!op->kernel_checks) op->config.skip = op->words;
  return op;
}

void verifyd_op_destroy(VerifydOp* op) {
  if (op == nullptr) return;
  cudaFree(op->workspace);
  cudaFree(op->lse);
  cudaFree(op->words);
  delete op;
}

}  // extern "C"

namespace {

// The kernel-side branch's last launch: the op's o and lse over the stack's, when it served.
cudaError_t CopyOut(const VerifydOp* op, const void* o, const uint8_t* failed, const float* lse,
                    const verifyd::op::CallExtras& x, cudaStream_t s) {
  CopyServed<<<op->deliver_blocks, kThreads, 0, s>>>(failed, static_cast<const uint4*>(o),
                                                     static_cast<uint4*>(x.copy_o), op->o_vectors,
                                                     lse, x.copy_lse, op->lse_n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t verifyd::op::Attend(VerifydOp* op, const VerifydOpCall* c,
                                const verifyd::op::CallExtras& x, cudaStream_t s) {
  if (op == nullptr || c == nullptr || c->q == nullptr || c->kv_pool == nullptr ||
      c->kv_indptr == nullptr || c->kv_indices == nullptr || c->kv_lens == nullptr ||
      c->mask == nullptr || c->o == nullptr || c->failed == nullptr ||
      (op->g.want_lse != 0) != (c->lse != nullptr)) {
    return cudaErrorInvalidValue;
  }
  const VerifydOpGeometry& g = op->g;
  VerifyProblem p = op->problem;
  p.q = static_cast<const uint16_t*>(c->q);
  p.kv_pool = static_cast<const uint16_t*>(c->kv_pool);
  p.kv_indptr = c->kv_indptr;
  p.kv_indices = c->kv_indices;
  p.kv_lens = c->kv_lens;
  p.tree_mask = c->mask;
  p.o = static_cast<uint16_t*>(c->o);
  p.lse = c->lse != nullptr ? c->lse : op->lse;
  cudaError_t e = cudaSuccess;
  if (op->kernel_checks) {
    CustomConfig config = op->config;
    verifyd::kernels::CustomCallChecks& k = config.checks;
    k.words = op->words;
    k.failed = c->failed;
    k.serve = x.serve;
    k.max_indices = static_cast<int64_t>(g.max_indices);
    k.max_kv_len = static_cast<int64_t>(g.max_kv_len);
    e = verifyd::kernels::LaunchCustom(p, config, op->workspace, op->workspace_bytes, s);
    if (e == cudaSuccess && x.set_fallback) {
      // The kernel cannot set the handle itself (kernel_checks.cuh): one thread does, after it.
      SetFallback<<<1, 32, 0, s>>>(c->failed, x.fallback);
      e = cudaGetLastError();
    }
    if (e != cudaSuccess || x.copy_o == nullptr) return e;
    return CopyOut(op, c->o, c->failed, p.lse, x, s);
  }
  CheckArgs ca{
      c->kv_indptr,
      c->kv_indices,
      c->kv_lens,
      c->mask,
      x.serve,
      static_cast<int64_t>(g.max_indices),
      static_cast<int64_t>(g.max_kv_len),
      op->mask_bytes,
      verifyd::kernels::PageIdLimit(static_cast<int64_t>(g.pool_pages)),
      static_cast<int>(g.batch),
      static_cast<int>(g.draft),
      static_cast<int>(g.page_size),
      static_cast<int>(g.mask_bits),
      static_cast<int>(verifyd::kernels::MaskRowBytes(op->problem.shape.mask_format, g.draft)),
      op->words};
  CheckCall<<<op->check_blocks, kThreads, 0, s>>>(ca);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  e = verifyd::kernels::LaunchCustom(p, op->config, op->workspace, op->workspace_bytes, s);
  if (e != cudaSuccess) return e;
  const DeliverArgs da{static_cast<const uint4*>(c->o),
                       op->o_vectors,
                       p.lse,
                       op->lse_n,
                       op->words,
                       c->failed,
                       x.set_fallback,
                       x.fallback};
  Deliver<<<op->deliver_blocks, kThreads, 0, s>>>(da);
  e = cudaGetLastError();
  if (e != cudaSuccess || x.copy_o == nullptr) return e;
  return CopyOut(op, c->o, c->failed, p.lse, x, s);
}

extern "C" {

int verifyd_op_attend(VerifydOp* op, const VerifydOpCall* c, void* stream) {
  return verifyd::op::Attend(op, c, verifyd::op::CallExtras{}, static_cast<cudaStream_t>(stream));
}

uint64_t verifyd_op_device_bytes(const VerifydOp* op) {
  return op == nullptr ? 0
                       : op->workspace_bytes + 2 * sizeof(unsigned) +
                             (op->lse != nullptr ? op->lse_n * sizeof(float) : 0);
}

uint32_t verifyd_op_checks_in_kernel(const VerifydOp* op) {
  return op != nullptr && op->kernel_checks ? 1 : 0;
}

const char* verifyd_op_build(void) { return VERIFYD_GIT_COMMIT; }

uint32_t verifyd_op_abi_version(void) { return kAbiVersion; }

}  // extern "C"
