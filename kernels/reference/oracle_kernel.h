#pragma once
// The sampled fp32 oracle on the GPU: the simplest kernel that computes the contract (README.md,
// "The computation") in fp32 from the inputs as sent, one thread block per query row. Slow by
// design; it shares nothing with the reference or custom paths: an e4m3 pool it reads itself (the
// hardware's conversion, times kv_scale in fp32), not through the pages those paths dequantise.

#include <cuda_runtime.h>

#include "kernels/verify_problem.h"

namespace verifyd::kernels {

// Reads p's inputs (p.o and p.lse are ignored; a kE4m3 pool is e4m3 x p.kv_scale); writes o_f32
// fp32 [B*T, H, 512] and lse fp32 [B*T, H] (-inf where a row sees nothing; lse may be null). No
// workspace.
cudaError_t LaunchOracle(const VerifyProblem& p, float* o_f32, float* lse, cudaStream_t stream);

}  // namespace verifyd::kernels
