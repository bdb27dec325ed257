#pragma once
// Host entry points of the fused paged MLA tree-verify kernel (the "custom" path).
// Launchers only: no allocation, no host synchronization.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Why a call of the in-process op is not to be served: the bits of its verdict word.
enum CallVerdict : unsigned {
  kVerdictLayoutBad = 1,   // kv_indptr, kv_lens against max_indices, max_kv_len and the pages
  kVerdictIndexBad = 2,    // a page id outside the pool
  kVerdictMaskBad = 4,     // a mask byte other than 0/1, or a bit set past T
  kVerdictNonFinite = 8,   // a NaN or Inf in o, or a row's lse not finite
  kVerdictNotServing = 16  // the call's serve byte was 0: it computed nothing
};

// The in-process op's checks made inside the kernels, in the shipped schedule (v5t) and its split
// combine: each CTA checks its request's layout, the page ids it reads (a bad one is read as
// page 0) and, in the first split, its rows of the mask; the store checks the output. The last
// CTA to finish (the combine's last block when the KV is split) turns the verdict into the call's
// `failed` byte. A call that fails may have written part of o and lse. `words` null: no checks
// (the engines' launches). The kernels set no conditional node's handle: a device-runtime call in
// a kernel with wgmma makes ptxas serialise every wgmma in it (C7510); the op sets a fallback's
// handle from `failed` in a kernel of its own.
struct CustomCallChecks {
  unsigned* words = nullptr;       // [0] the verdict bits, [1] CTAs finished: zero between calls
  uint8_t* failed = nullptr;       // written by the last CTA: 1 when the verdict is not 0, else 0
  const uint8_t* serve = nullptr;  // null, or a device byte: 0 makes the call compute nothing
  int64_t max_indices = 0;         // kv_indptr[B] may not exceed it
  int64_t max_kv_len = 0;          // nor any kv_len this
};

struct CustomConfig {
  bool small_smem = false;  // sm_120-sized tiles (~99 KB shared memory per block)
  int num_sms = 0;          // multiprocessors to plan the KV split for; 0 = ask the device
  int force_splits = 0;     // tests only: fixed KV split count; 0 = choose from the problem
  // Device word read when the kernels run: nonzero makes them write nothing (the in-process op's
  // checks failed). Null: they always run.
  const unsigned* skip = nullptr;
  // The op's checks inside the kernels (CustomChecksInKernel); not with `skip`.
  CustomCallChecks checks;
};

// Reads VERIFYD_FORCE_SM120_CONFIG=1 from the environment into `small_smem`.
CustomConfig CustomConfigFromEnv();

// Bytes of device workspace LaunchCustom needs for `p` (split-KV partials).
size_t CustomWorkspaceBytes(const VerifyProblem& p, const CustomConfig& c);

// Whether LaunchCustom makes `checks` inside its kernels for `p` (the plan is v5t); else a
// launch with checks is refused, and the op runs its check kernels around the kernel instead.
bool CustomChecksInKernel(const VerifyProblem& p, const CustomConfig& c);

// Computes p.o (and p.lse when set) on `stream`. `p` must have passed CheckShape() and the
// bundle validation; returns the launch error, if any.
cudaError_t LaunchCustom(const VerifyProblem& p, const CustomConfig& c, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream);

}  // namespace verifyd::kernels
