#pragma once
// The fp64 oracle of the contract (README.md, "The computation") on the host: a two-pass softmax
// per query row in double, from the bundle's bf16 inputs. It is the truth both the reference and
// the custom path are measured against.

#include <vector>

#include "src/bundle/bundle.h"
#include "src/cpu_engine/call_poll.h"
#include "src/engine/call_context.h"

namespace verifyd {

// Heads [h0, h1) of draft token i of request b. o: [h1-h0, 512], lse: [h1-h0] (natural log).
// A row that sees nothing gets zeros and lse -inf. With `poll`, stops between keys once its call
// is abandoned and returns false (o and lse then incomplete).
bool OracleTokenHeads(const BundleView& v, int b, int i, int h0, int h1, double* o, double* lse,
                      CallPoll* poll = nullptr);

// Heads [h0, h1) of every draft token of request b, written into the full outputs
// o: [B*T, H, 512], lse: [B*T, H]. With `call`, stops between keys once the call is abandoned
// (the outputs are then incomplete).
void OracleRequestHeads(const BundleView& v, int b, int h0, int h1, double* o, double* lse,
                        const CallContext* call = nullptr);

// The whole bundle on the calling thread. o: [B*T, H, 512], lse: [B*T, H].
void RunOracle(const BundleView& v, std::vector<double>* o, std::vector<double>* lse);

}  // namespace verifyd
