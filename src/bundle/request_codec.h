#pragma once
// verifyd.v1 messages <-> bundles: decoding checks every tensor's dtype, shape and byte size,
// then ValidateBundle() checks the contents. The view points into the request's bytes.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"
#include "src/bundle/request_in_place.h"
#include "src/region/region_registry.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

// A decoded call: its bundle and what keeps the bundle's memory valid while the call runs.
struct DecodedRequest {
  BundleView view;
  // The regions the call reads or writes, pinned until the call ends.
  std::vector<RegionPin> pins;
  // Small tensors named in a region (indices, lengths, mask), copied into verifyd's memory:
  // verifyd checks their contents there, out of reach of the client's later writes. Page ids and
  // mask that a GPU holds with the pool stay there (BundleView::indices_device).
  std::vector<std::vector<char>> host_copies;
  // Where the served output goes instead of the response (o_out, lse_out).
  std::optional<RegionRange> o_out, lse_out;
  const RegionRange* lse_out_range() const { return lse_out ? &*lse_out : nullptr; }
};

// Tensors may be inline bytes or ranges of regions registered in `regions` (null: none are) that
// `caller` may use (RegionRegistry::Resolve).
// Checks each tensor's dtype, shape and byte size, where it is (a CUDA IPC region must be on the
// request's device), then the contents (ValidateBundle). `in_place` (ParseRequestInPlace): where
// the inline bytes of q and kv_pool are when the message does not hold them; the view then points
// there.
absl::Status DecodeRequest(const v1::VerifyRequest& req, const RegionRegistry* regions,
                           const Peer& caller, DecodedRequest* out,
                           const InPlaceTensors* in_place = nullptr);
// Inline tensors only.
absl::StatusOr<BundleView> DecodeRequest(const v1::VerifyRequest& req);

// Fills `req` from a view (raw little-endian bytes). With `bulk`, q's and kv_pool's bytes are not
// copied into `req`: their raw_contents stay empty and `bulk` names the view's (to be sent with
// SerializeRequestAround).
void EncodeRequest(const BundleView& v, v1::VerifyRequest* req, InPlaceTensors* bulk = nullptr);

// Output tensors: o bf16 [B*T, H, 512], lse f32 [B*T, H].
void EncodeBf16(const std::vector<int64_t>& shape, const uint16_t* data, v1::Tensor* t);
void EncodeF32(const std::vector<int64_t>& shape, const float* data, v1::Tensor* t);

}  // namespace verifyd
