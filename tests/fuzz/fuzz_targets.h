#pragma once
// The entry points the fuzzers drive, each one input parsed the way the daemon or verifyctl
// parses it. libFuzzer runs them in tests/fuzz/fuzz_main.cc; test_fuzz_corpus replays the seed
// corpus and the kept crashing inputs through them in the regular builds.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace verifyd::fuzz {

// Every entry point returns what the input deserves; INTERNAL means an invariant broke.

// A VerifyRequest's wire bytes: parse as the daemon parses a channel's call (ParseRequestInPlace;
// INTERNAL when it disagrees with protobuf's own parse), decode, validate; on success touch every
// byte an engine would read.
absl::Status Request(const uint8_t* data, size_t size);
// A .safetensors file as `verifyctl replay` reads it: parse, map to a bundle, validate, touch.
absl::Status Safetensors(const uint8_t* data, size_t size);
// state.json's text, and audit.jsonl's lines, as the state store parses them; what parses must
// serialize and parse back to the same text (INTERNAL when it does not: a bug, never an input
// error).
absl::Status State(const uint8_t* data, size_t size);
// A call channel's shared memory as a client may leave it (header, request area; padded with
// zeros to the smallest channel): the request found where verifyd finds it, then served by
// Request(). INTERNAL when it is not inside the request area.
absl::Status Channel(const uint8_t* data, size_t size);
absl::Status Audit(const uint8_t* data, size_t size);
// A doorbell call (src/channel/doorbell_layout.h) as verifyd builds it from two fixed
// descriptors: the input's first 4 bytes are the doorbell word, the rest the request area with
// its layout slots. INTERNAL when the built call leaves the descriptor's ranges or disagrees with
// its own layout.
absl::Status Doorbell(const uint8_t* data, size_t size);

// One message on the descriptor socket (src/transport/vmm_fd_payload.h): the input's first byte
// is how many descriptors came with it, the rest its payload. INTERNAL when an accepted message
// breaks its bounds or does not write back to the same payload.
absl::Status VmmFds(const uint8_t* data, size_t size);

// A tap slot's record (src/channel/tap_layout.h) as verifyd builds a call from it: the input
// is the record. INTERNAL when the built call leaves the slot's ranges or disagrees with itself.
absl::Status Tap(const uint8_t* data, size_t size);

// A fleet's desired state (src/fleet/desired_state.h) as a node reads its file: what parses
// must serialize and parse back to the same text (INTERNAL when it does not).
absl::Status DesiredState(const uint8_t* data, size_t size);

// A rollout plan (src/fleet/rollout_plan.h) as `verifyctl fleet` reads its file: what parses must
// serialize and parse back to the same text (INTERNAL when it does not), and every step of it
// must make a desired state that a node parses.
absl::Status RolloutPlan(const uint8_t* data, size_t size);

struct Target {
  const char* name;  // the corpus directory: tests/fuzz/corpus/<name>, regressions/<name>
  absl::Status (*run)(const uint8_t*, size_t);
};
const std::vector<Target>& Targets();

}  // namespace verifyd::fuzz
