#pragma once
// The custom kernel's algorithm on the CPU: all T*H query rows of a request against shared KV
// tiles, fp32 online softmax, bf16 probabilities into P·V, the KV sequence split into chunks whose
// partial (o, lse) merge by log-sum-exp, and the tree mask applied only on tiles covering the tail.
// It shares no code with the oracle or the reference.

#include <cstdint>
#include <vector>

#include "src/bundle/bundle.h"
#include "src/engine/call_context.h"

namespace verifyd {

struct CpuCustomConfig {
  int tile_tokens = 64;        // KV tokens per tile
  int min_chunk_tokens = 256;  // smallest KV split; rounded up to whole tiles
  int max_splits = 8;          // most KV splits per request
  bool pv_bf16 = false;        // test-only fault: the P·V accumulator rounded to bf16 per key
  int force_splits = 0;        // > 0: this many KV splits of whole tiles (at most one per tile)
};

// Heads [h0, h1) of every draft token of request b, written into the full outputs
// o: bf16 [B*T, H, 512], lse: fp32 [B*T, H] (may be null).
// With `call`, stops between the rows of a tile once the call is abandoned (the outputs are then
// incomplete).
void CustomRequestHeads(const BundleView& v, int b, int h0, int h1, const CpuCustomConfig& c,
                        uint16_t* o, float* lse, const CallContext* call = nullptr);

// The whole bundle on the calling thread.
void RunCustom(const BundleView& v, const CpuCustomConfig& c, std::vector<uint16_t>* o,
               std::vector<float>* lse);

}  // namespace verifyd
