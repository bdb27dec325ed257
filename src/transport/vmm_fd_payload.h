#pragma once
// The payload of one message on verifyd's descriptor socket (the data socket's path + ".fds",
// SOCK_SEQPACKET): a client sends the file descriptors of its CUDA VMM chunks
// (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) in SCM_RIGHTS, under a
// token it chose, and then names the token in RegisterCudaVmmRegion. A set of more descriptors
// than one message carries (kVmmFdsPerMessage) goes in several messages, in order.
//
// The payload is kVmmFdPayloadBytes, little-endian:
//   0   4 bytes   magic "VMFD"
//   4  16 bytes   token (not all zeros)
//  20   u32       first: the index, in the token's set, of this message's first descriptor
//  24   u32       total: how many descriptors the token's set holds once complete
// verifyd answers each message with one packet: "ok" or the error, which names the field.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace verifyd {

inline constexpr size_t kVmmFdPayloadBytes = 28;
inline constexpr size_t kVmmTokenBytes = 16;
inline constexpr char kVmmFdMagic[] = "VMFD";
// The kernel's SCM_MAX_FD: the most descriptors one SCM_RIGHTS message carries.
inline constexpr uint32_t kVmmFdsPerMessage = 253;

struct VmmFdMessage {
  std::string token;  // kVmmTokenBytes bytes
  uint32_t first = 0;
  uint32_t total = 0;
};

// Parses `payload`, which came with `fds` descriptors. INVALID_ARGUMENT naming the field
// (`payload`, `magic`, `token`, `fds`, `total`, `first`) when it is not a message verifyd takes;
// `max_total` bounds `total` (the most descriptors one token may hold).
absl::StatusOr<VmmFdMessage> ParseVmmFdPayload(absl::string_view payload, size_t fds,
                                               uint32_t max_total);

// The payload of a message (clients and tests).
std::string VmmFdPayload(absl::string_view token, uint32_t first, uint32_t total);

}  // namespace verifyd
