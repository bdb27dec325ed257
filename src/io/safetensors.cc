#include "src/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace verifyd {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this host reads it in place");

constexpr uint64_t kMaxHeaderBytes = 100 << 20;  // as Python's safetensors
constexpr char kMetadataKey[] = "__metadata__";

struct DTypeInfo {
  DType type;
  const char* name;
  int size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},        {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},   {DType::kI32, "I32", 4},        {DType::kI64, "I64", 8},
    {DType::kU8, "U8", 1},     {DType::kF8E4M3, "F8_E4M3", 1},
};

// numel of `shape`, or nullopt on a negative dimension or overflow.
std::optional<int64_t> Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return std::nullopt;
    n *= d;
  }
  return n;
}

absl::Status Corrupt(const std::string& what, const std::string& why) {
  return absl::DataLossError(absl::StrCat(what, ": ", why));
}

// ErrnoToStatus appends ": " and the system's reason itself.
absl::Status FromErrno(int err, const std::string& what) { return absl::ErrnoToStatus(err, what); }

uint64_t ReadLe64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Parses the JSON header into tensors with shapes and offsets (relative to the data section),
// checking each against `data_bytes`.
struct Entry {
  std::string name;
  Tensor tensor;
  uint64_t begin = 0, end = 0;
};
absl::StatusOr<std::vector<Entry>> ParseHeader(std::string_view header, uint64_t data_bytes,
                                               const std::string& what,
                                               std::map<std::string, std::string>* metadata) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(what, absl::StrCat("header is not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return Corrupt(what, "header is not a JSON object");
  std::vector<Entry> entries;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == kMetadataKey) {
      if (!v.is_object()) return Corrupt(what, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Corrupt(what, absl::StrCat("__metadata__[", m.key(), "] is not a string"));
        }
        (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor '", name, "'");
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return Corrupt(what, where + " needs dtype, shape and data_offsets");
    }
    Entry e;
    e.name = name;
    const nlohmann::json& dt = v["dtype"];
    std::optional<DType> dtype = dt.is_string() ? ParseDType(dt.get<std::string>()) : std::nullopt;
    if (!dtype) return Corrupt(what, absl::StrCat(where, " has unsupported dtype ", dt.dump()));
    e.tensor.dtype = *dtype;
    const nlohmann::json& shape = v["shape"];
    if (!shape.is_array()) return Corrupt(what, where + " shape is not an array");
    for (const auto& d : shape) {
      if (!d.is_number_integer()) return Corrupt(what, where + " shape has a non-integer entry");
      e.tensor.shape.push_back(d.get<int64_t>());
    }
    const std::optional<int64_t> numel = Numel(e.tensor.shape);
    if (!numel || *numel > std::numeric_limits<int64_t>::max() / DTypeSize(*dtype)) {
      return Corrupt(what, absl::StrCat(where, " has bad shape ", shape.dump()));
    }
    const nlohmann::json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return Corrupt(what, where + " data_offsets is not [begin, end]");
    }
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end) return Corrupt(what, where + " data_offsets has begin > end");
    const uint64_t want = static_cast<uint64_t>(*numel) * DTypeSize(*dtype);
    if (e.end - e.begin != want) {
      return Corrupt(
          what, absl::StrCat(where, " holds ", e.end - e.begin, " bytes but ", DTypeName(*dtype),
                             " ", ShapeString(e.tensor.shape), " needs ", want));
    }
    if (e.end > data_bytes) {
      return Corrupt(what, absl::StrCat(where, " ends at byte ", e.end, " of the data but only ",
                                        data_bytes, " are present (truncated file?)"));
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

const char* DTypeName(DType t) {
  for (const auto& d : kDTypes) {
    if (d.type == t) return d.name;
  }
  return "?";
}

int DTypeSize(DType t) {
  for (const auto& d : kDTypes) {
    if (d.type == t) return d.size;
  }
  return 0;
}

std::optional<DType> ParseDType(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.type;
  }
  return std::nullopt;
}

int64_t Tensor::numel() const { return Numel(shape).value_or(0); }

const Tensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes, const std::string& what) {
  if (bytes.size() < 8) {
    return Corrupt(what, absl::StrCat("file is ", bytes.size(),
                                      " bytes, shorter than the 8-byte header length"));
  }
  const uint64_t header_len = ReadLe64(bytes.data());
  if (header_len > kMaxHeaderBytes || header_len > bytes.size() - 8) {
    return Corrupt(what, absl::StrCat("header length ", header_len, " does not fit in the ",
                                      bytes.size(), "-byte file"));
  }
  SafetensorsFile file;
  const uint64_t data_bytes = bytes.size() - 8 - header_len;
  auto entries = ParseHeader(bytes.substr(8, header_len), data_bytes, what, &file.metadata);
  if (!entries.ok()) return entries.status();
  const char* data = bytes.data() + 8 + header_len;
  for (Entry& e : *entries) {
    e.tensor.data.resize(e.end - e.begin);
    if (!e.tensor.data.empty()) std::memcpy(e.tensor.data.data(), data + e.begin, e.end - e.begin);
    file.tensors.emplace(e.name, std::move(e.tensor));
  }
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FromErrno(errno, path);
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  if (size < 8) {
    return Corrupt(path,
                   absl::StrCat("file is ", size, " bytes, shorter than the 8-byte header length"));
  }
  char len_bytes[8];
  in.read(len_bytes, 8);
  const uint64_t header_len = ReadLe64(len_bytes);
  if (!in || header_len > kMaxHeaderBytes || header_len > static_cast<uint64_t>(size) - 8) {
    return Corrupt(path, absl::StrCat("header length ", header_len, " does not fit in the ", size,
                                      "-byte file"));
  }
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!in) return Corrupt(path, "could not read the header");

  SafetensorsFile file;
  const uint64_t data_start = 8 + header_len;
  auto entries = ParseHeader(header, size - data_start, path, &file.metadata);
  if (!entries.ok()) return entries.status();
  // Read each tensor straight into its own buffer: no second copy of a large KV pool.
  for (Entry& e : *entries) {
    e.tensor.data.resize(e.end - e.begin);
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    in.read(reinterpret_cast<char*>(e.tensor.data.data()),
            static_cast<std::streamsize>(e.end - e.begin));
    if (!in) return Corrupt(path, absl::StrCat("could not read tensor '", e.name, "'"));
    file.tensors.emplace(e.name, std::move(e.tensor));
  }
  return file;
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::set<std::string> names;
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", t.name, "' is reserved"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' appears twice"));
    }
    const std::optional<int64_t> numel = Numel(t.shape);
    if (!numel) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' has bad shape ", ShapeString(t.shape)));
    }
    const uint64_t bytes = static_cast<uint64_t>(*numel) * DTypeSize(t.dtype);
    if (bytes > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has no data"));
    }
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // data starts 8-byte aligned, as Python's writer does

  std::string out;
  out.reserve(8 + h.size() + offset);
  const uint64_t len = h.size();
  out.append(reinterpret_cast<const char*>(&len), 8);
  out.append(h);
  for (size_t k = 0; k < tensors.size(); ++k) {
    out.append(static_cast<const char*>(tensors[k].data), sizes[k]);
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  auto bytes = SerializeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();

  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = mkstemp(tmp.data());
  if (fd < 0) return FromErrno(errno, absl::StrCat("create a temporary file next to ", path));
  auto fail = [&](const std::string& step) {
    const int err = errno;
    close(fd);
    unlink(tmp.c_str());
    return FromErrno(err, absl::StrCat(step, " ", tmp));
  };
  if (fchmod(fd, 0644) != 0) return fail("chmod");
  const char* p = bytes->data();
  size_t left = bytes->size();
  while (left > 0) {
    const ssize_t n = write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("write");
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) return fail("fsync");
  if (close(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return FromErrno(err, absl::StrCat("close ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return FromErrno(err, absl::StrCat("rename ", tmp, " to ", path));
  }
  // The rename itself is durable only once the directory is synced.
  if (const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY); dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : file.tensors) {
    refs.push_back({name, t.dtype, t.shape, t.data.data()});
  }
  return WriteSafetensors(path, refs, file.metadata);
}

}  // namespace verifyd
