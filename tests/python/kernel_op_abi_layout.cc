// Prints the C layout of the in-process op's and switch's structs (kernels/op/verify_op_api.h) as
// JSON, for kernel_op_abi_test.py to hold verifyd_client.kernel_op's ctypes mirror to.

#include <cstddef>
#include <cstdio>

#include "kernels/op/verify_op_api.h"

#define FIELD(type, name) std::printf("\"%s\": %zu, ", #name, offsetof(type, name))

int main() {
  std::printf("{\"VerifydOpGeometry\": {");
  FIELD(VerifydOpGeometry, batch);
  FIELD(VerifydOpGeometry, draft);
  FIELD(VerifydOpGeometry, heads);
  FIELD(VerifydOpGeometry, page_size);
  FIELD(VerifydOpGeometry, pool_pages);
  FIELD(VerifydOpGeometry, max_indices);
  FIELD(VerifydOpGeometry, max_kv_len);
  FIELD(VerifydOpGeometry, mask_bits);
  FIELD(VerifydOpGeometry, want_lse);
  FIELD(VerifydOpGeometry, sm_scale);
  FIELD(VerifydOpGeometry, kv_dtype);
  FIELD(VerifydOpGeometry, kv_scale);
  std::printf("\"sizeof\": %zu}, \"VerifydOpCall\": {", sizeof(VerifydOpGeometry));
  FIELD(VerifydOpCall, q);
  FIELD(VerifydOpCall, kv_pool);
  FIELD(VerifydOpCall, kv_indptr);
  FIELD(VerifydOpCall, kv_indices);
  FIELD(VerifydOpCall, kv_lens);
  FIELD(VerifydOpCall, mask);
  FIELD(VerifydOpCall, o);
  FIELD(VerifydOpCall, lse);
  FIELD(VerifydOpCall, failed);
  std::printf("\"sizeof\": %zu}, \"VerifydSwitchBlock\": {", sizeof(VerifydOpCall));
  FIELD(VerifydSwitchBlock, magic);
  FIELD(VerifydSwitchBlock, mode);
  FIELD(VerifydSwitchBlock, canary_threshold);
  FIELD(VerifydSwitchBlock, lease_period_us);
  FIELD(VerifydSwitchBlock, lease_epoch);
  FIELD(VerifydSwitchBlock, steps);
  FIELD(VerifydSwitchBlock, op_steps);
  FIELD(VerifydSwitchBlock, lease_expired);
  FIELD(VerifydSwitchBlock, seen_epoch);
  FIELD(VerifydSwitchBlock, seen_at_ns);
  FIELD(VerifydSwitchBlock, last_step_ns);
  std::printf("\"sizeof\": %zu, \"magic_value\": %u}}\n", sizeof(VerifydSwitchBlock),
              VERIFYD_SWITCH_MAGIC);
  return 0;
}
