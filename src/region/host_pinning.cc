#include "src/region/host_pinning.h"

#include "spdlog/spdlog.h"

namespace verifyd {

PinnedHost PinHost(const HostPinner& pin, char* base, uint64_t bytes, std::string_view what) {
  PinnedHost p;
  if (!pin) return p;
  const absl::Time t = absl::Now();
  absl::StatusOr<std::function<void()>> unpin = pin(base, bytes);
  p.took = absl::Now() - t;
  if (unpin.ok()) {
    p.unpin = std::move(*unpin);
  } else {
    spdlog::warn("{}: not pinned, its bytes are staged through a copy: {}", what,
                 unpin.status().ToString());
  }
  return p;
}

}  // namespace verifyd
