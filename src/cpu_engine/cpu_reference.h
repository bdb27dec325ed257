#pragma once
// The CPU reference path: plain loops with fp64 accumulation (the oracle), rounded to the
// output dtypes: o bf16, lse fp32.

#include <cstdint>
#include <vector>

#include "src/bundle/bundle.h"
#include "src/engine/call_context.h"

namespace verifyd {

// Heads [h0, h1) of every draft token of request b, written into the full outputs
// o: bf16 [B*T, H, 512], lse: fp32 [B*T, H] (may be null).
// With `call`, stops between keys once the call is abandoned (the outputs are then incomplete).
void ReferenceRequestHeads(const BundleView& v, int b, int h0, int h1, uint16_t* o, float* lse,
                           const CallContext* call = nullptr);

// The whole bundle on the calling thread.
void RunReference(const BundleView& v, std::vector<uint16_t>* o, std::vector<float>* lse);

}  // namespace verifyd
