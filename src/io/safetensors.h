#pragma once
// The safetensors file format: an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets} plus an optional "__metadata__" string map, then the
// raw little-endian tensor bytes. Files written here load with Python's safetensors and torch.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace verifyd {

enum class DType { kBF16, kF16, kF32, kF64, kI32, kI64, kU8, kF8E4M3 };  // kF8E4M3: "F8_E4M3"

const char* DTypeName(DType t);  // "BF16", "F32", ...
int DTypeSize(DType t);          // bytes per element
std::optional<DType> ParseDType(std::string_view name);
// "[2, 3, 576]": a shape as errors name it.
std::string ShapeString(const std::vector<int64_t>& shape);

// One tensor with its bytes (little-endian, row-major).
struct Tensor {
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;

  int64_t numel() const;
  // The bytes as T; the storage comes from operator new, aligned for every dtype above.
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data.data());
  }
  template <typename T>
  T* mutable_as() {
    return reinterpret_cast<T*>(data.data());
  }
};

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;

  const Tensor* Find(const std::string& name) const;
};

// A tensor to write that lives elsewhere: `data` holds numel(shape) * DTypeSize(dtype) bytes.
struct TensorRef {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// NOT_FOUND when the file is missing; DATA_LOSS naming what is wrong when it is truncated or its
// header is malformed.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);
// The same checks on bytes in memory; `what` names the source in errors.
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes, const std::string& what);

// The serialized file. INVALID_ARGUMENT on a duplicate or reserved name or a negative dimension.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata);
// Written atomically: a temporary file in the same directory, fsync, rename over `path`.
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                              const std::map<std::string, std::string>& metadata);
absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);

}  // namespace verifyd
