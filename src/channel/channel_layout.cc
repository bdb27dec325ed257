#include "src/channel/channel_layout.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace verifyd::channel {

absl::StatusOr<Geometry> GeometryFor(uint64_t byte_size, uint64_t max_capacity) {
  if (byte_size < kMinBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: a channel needs at least ", kMinBytes, " bytes, not ", byte_size));
  }
  uint64_t area = (byte_size - kHeaderBytes) / 2;
  area = std::min<uint64_t>({area, max_capacity, UINT32_MAX});
  area -= area % kAreaAlign;
  if (area < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: areas of ", area, " bytes are too small (at least 4096)"));
  }
  Geometry g;
  g.capacity = static_cast<uint32_t>(area);
  g.request_offset = kHeaderBytes;
  g.response_offset = kHeaderBytes + area;
  return g;
}

void InitHeader(char* base, const Geometry& g) {
  std::memset(base, 0, kHeaderBytes);
  Header* h = new (base) Header{};
  h->magic = kMagic;
  h->version = kVersion;
  h->capacity = g.capacity;
  h->request_seq.store(0, std::memory_order_relaxed);
  h->request_bytes.store(0, std::memory_order_relaxed);
  h->response_seq.store(0, std::memory_order_relaxed);
  h->response_bytes.store(0, std::memory_order_relaxed);
  h->state.store(kStateOpen, std::memory_order_release);
}

absl::StatusOr<absl::string_view> RequestIn(const char* base, const Geometry& g) {
  const uint32_t bytes = HeaderOf(base)->request_bytes.load(std::memory_order_relaxed);
  if (bytes == 0 || bytes > g.capacity) {
    return absl::InvalidArgumentError(absl::StrCat("request_bytes: ", bytes,
                                                   " is not a request size in this channel (1 to ",
                                                   g.capacity, " bytes)"));
  }
  return absl::string_view(base + g.request_offset, bytes);
}

void PublishResponse(char* base, uint32_t bytes, uint32_t seq) {
  Header* h = HeaderOf(base);
  h->response_bytes.store(bytes, std::memory_order_relaxed);
  h->response_seq.store(seq, std::memory_order_release);
}

}  // namespace verifyd::channel
