#pragma once
// A serialized VerifyRequest parsed without copying its bulk: the inline bytes of q and kv_pool
// (raw_contents, the megabytes of a call) stay where the message is; every other byte (the small
// tensors verifyd checks, the scalars, unknown fields) is copied into the message. For a message
// in memory the client shares (a call channel's request area), what verifyd checks is then out
// of the client's reach, and q and kv_pool, which no check reads, are read where they are.

#include <optional>

#include "absl/strings/string_view.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

// Where the inline bytes of q and kv_pool are when they are not in the message.
struct InPlaceTensors {
  // Set when the tensor's contents are inline bytes (raw_contents); the message's raw_contents
  // is then empty and these are its bytes. nullopt: the message holds them (or names a region).
  std::optional<absl::string_view> q, kv_pool;
};

// What VerifyRequest::ParseFromArray(wire) gives, except that q's and kv_pool's raw_contents are
// left in `wire` and named in `bulk`. False where ParseFromArray would fail; `bulk` is then
// empty.
bool ParseRequestInPlace(absl::string_view wire, v1::VerifyRequest* req, InPlaceTensors* bulk);

}  // namespace verifyd
