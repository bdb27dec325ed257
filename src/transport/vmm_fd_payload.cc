#include "src/transport/vmm_fd_payload.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

uint32_t LoadU32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

void StoreU32(uint32_t v, std::string* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

absl::StatusOr<VmmFdMessage> ParseVmmFdPayload(absl::string_view payload, size_t fds,
                                               uint32_t max_total) {
  if (payload.size() != kVmmFdPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload: ", payload.size(), " bytes, expected ", kVmmFdPayloadBytes,
                     " (magic \"VMFD\", a 16-byte token, first and total as little-endian u32)"));
  }
  if (std::memcmp(payload.data(), kVmmFdMagic, 4) != 0) {
    return absl::InvalidArgumentError("magic: the payload does not start with \"VMFD\"");
  }
  VmmFdMessage m;
  m.token.assign(payload.data() + 4, kVmmTokenBytes);
  if (m.token.find_first_not_of('\0') == std::string::npos) {
    return absl::InvalidArgumentError("token: all zeros; choose 16 random bytes");
  }
  m.first = LoadU32(payload.data() + 20);
  m.total = LoadU32(payload.data() + 24);
  if (fds == 0) {
    return absl::InvalidArgumentError(
        "fds: the message carries no descriptors (send them in SCM_RIGHTS)");
  }
  if (fds > kVmmFdsPerMessage) {
    return absl::InvalidArgumentError(absl::StrCat("fds: ", fds,
                                                   " descriptors, the most one "
                                                   "message carries is ",
                                                   kVmmFdsPerMessage));
  }
  if (m.total == 0 || m.total > max_total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total: ", m.total, " descriptors, expected 1 to ", max_total, " for one token"));
  }
  if (m.first >= m.total || fds > m.total - m.first) {
    return absl::InvalidArgumentError(absl::StrCat("first: descriptors ", m.first, " to ",
                                                   uint64_t{m.first} + fds - 1,
                                                   " do not fit in the token's ", m.total));
  }
  return m;
}

std::string VmmFdPayload(absl::string_view token, uint32_t first, uint32_t total) {
  std::string out(kVmmFdMagic, 4);
  out.append(token.data(), token.size());
  StoreU32(first, &out);
  StoreU32(total, &out);
  return out;
}

}  // namespace verifyd
