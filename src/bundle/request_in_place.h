#pragma once
// A serialized VerifyRequest parsed without copying its bulk: the inline bytes of q and kv_pool
// (raw_contents, the megabytes of a call) stay where the message is; every other byte (the small
// tensors verifyd checks, the scalars, unknown fields) is copied into the message. For a message
// in memory the client shares (a call channel's request area), what verifyd checks is then out
// of the client's reach, and q and kv_pool, which no check reads, are read where they are.
// And the other way, for a client: a request serialized around its bulk, which is sent from where
// it lies instead of being copied into the message and then into its serialized form.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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

// A request's wire form in pieces: every byte but the bulk in `small`, and the bulk's bytes where
// they lie, each to go in at its offset of `small`.
struct RequestPieces {
  struct Insert {
    size_t at;                // offset in `small`, ascending
    absl::string_view bytes;  // not owned
  };
  std::string small;
  std::vector<Insert> bulk;

  uint64_t size() const;
  // In order: concatenated, they are the serialized request. They point into this object (not
  // callable on a temporary).
  std::vector<absl::string_view> Pieces() const&;
  std::vector<absl::string_view> Pieces() const&& = delete;
};

// `req` serialized with q's and kv_pool's raw_contents taken from `bulk` where it names them
// (what `req` holds there is overridden: leave it empty). The bulk is appended as a later q and
// kv_pool field, which protobuf's parse merges into the first. ParseRequestInPlace of the pieces,
// concatenated, gives `req` back with `bulk` pointing into them.
RequestPieces SerializeRequestAround(const v1::VerifyRequest& req, const InPlaceTensors& bulk);

}  // namespace verifyd
