#pragma once
// What the switch (verify_switch.cu) asks of one op call beyond verify_op_attend's contract.

#include <cuda_runtime.h>

#include "kernels/op/verify_op_api.h"

namespace verifyd::op {

struct CallExtras {
  // Non-null: the call serves only when this device byte is nonzero; else it computes nothing,
  // and its `failed` byte is 1.
  const uint8_t* serve = nullptr;
  // Set: the last check also sets this conditional node's handle to the call's `failed`, so the
  // stack's attention runs in the op's branch exactly when the op's output is not to be served.
  bool set_fallback = false;
  cudaGraphConditionalHandle fallback{};
  // Non-null: the call computes into its own o (and lse), and a last kernel copies them here when
  // the call served and passed every check.
  void* copy_o = nullptr;
  float* copy_lse = nullptr;
};

// verifyd_op_attend with `extras`: the launches' cudaError_t.
cudaError_t Attend(VerifydOp* op, const VerifydOpCall* call, const CallExtras& extras,
                   cudaStream_t stream);

}  // namespace verifyd::op
