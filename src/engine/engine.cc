#include "src/engine/engine.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace verifyd {

absl::Status Engine::Deliver(Path path, PreparedBundle& b, const RegionRange& o,
                             const RegionRange* lse) {
  if (o.device() >= 0 || (lse != nullptr && lse->device() >= 0)) {
    return absl::FailedPreconditionError(
        "o_out: this engine writes outputs into shared-memory regions only");
  }
  PathOutput out;
  if (absl::Status st = Fetch(path, b, &out); !st.ok()) return st;
  const size_t o_bytes = out.o.size() * sizeof(uint16_t);
  if (o_bytes != o.byte_size) {
    return absl::InternalError(
        absl::StrCat("o_out: ", o.byte_size, " bytes for an output of ", o_bytes));
  }
  std::memcpy(o.data, out.o.data(), o_bytes);
  if (lse != nullptr) {
    const size_t lse_bytes = out.lse.size() * sizeof(float);
    if (lse_bytes != lse->byte_size) {
      return absl::InternalError(
          absl::StrCat("lse_out: ", lse->byte_size, " bytes for an output of ", lse_bytes));
    }
    std::memcpy(lse->data, out.lse.data(), lse_bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::DeliverIfFinite(Path path, PreparedBundle& b, const RegionRange& o,
                                             const RegionRange* lse) {
  absl::StatusOr<bool> finite = AllFinite(path, b);
  if (!finite.ok() || !*finite) return finite;
  if (absl::Status st = Deliver(path, b, o, lse); !st.ok()) return st;
  return true;
}

absl::Status Engine::ZeroFill(const RegionRange& r) {
  if (r.device() >= 0) {
    return absl::FailedPreconditionError(
        "o_out: this engine writes outputs into shared-memory regions only");
  }
  std::memset(r.data, 0, r.byte_size);
  return absl::OkStatus();
}

absl::Status Engine::ReadRange(const RegionRange& r, void* dst) {
  if (r.device() >= 0) {
    return absl::FailedPreconditionError(
        "this engine reads shared-memory regions only, not a CUDA region");
  }
  std::memcpy(dst, r.data, r.byte_size);
  return absl::OkStatus();
}

absl::Status Engine::WriteRange(const RegionRange& r, const void* src) {
  if (r.device() >= 0) {
    return absl::FailedPreconditionError(
        "this engine writes shared-memory regions only, not a CUDA region");
  }
  std::memcpy(r.data, src, r.byte_size);
  return absl::OkStatus();
}

}  // namespace verifyd
