#pragma once
// verifyd.v1 messages <-> bundles: decoding checks every tensor's dtype, shape and byte size,
// then ValidateBundle() checks the contents. The view points into the request's bytes.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

absl::StatusOr<BundleView> DecodeRequest(const v1::VerifyRequest& req);

// Fills `req` from a view (raw little-endian bytes).
void EncodeRequest(const BundleView& v, v1::VerifyRequest* req);

// Output tensors: o bf16 [B*T, H, 512], lse f32 [B*T, H].
void EncodeBf16(const std::vector<int64_t>& shape, const uint16_t* data, v1::Tensor* t);
void EncodeF32(const std::vector<int64_t>& shape, const float* data, v1::Tensor* t);

}  // namespace verifyd
