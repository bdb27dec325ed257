#include "src/bundle/request_in_place.h"

#include <climits>
#include <cstdint>
#include <string>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"

namespace verifyd {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

// The next field's tag as protobuf's parser reads it: at most five bytes, the bits past 32
// dropped, field number not 0 (CodedInputStream::ReadTag would take a longer varint).
bool ReadTag(CodedInputStream& in, uint32_t* tag) {
  const int at = in.CurrentPosition();
  uint64_t v = 0;
  if (!in.ReadVarint64(&v) || in.CurrentPosition() - at > 5) return false;
  *tag = static_cast<uint32_t>(v);
  return WireFormatLite::GetTagFieldNumber(*tag) != 0;
}

bool IsLengthDelimited(uint32_t tag) {
  return WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
}

// Reads a length-delimited field's length after its tag, and the bytes it spans in `data`.
bool ReadSpan(CodedInputStream& in, const char* data, int size, absl::string_view* span) {
  int len = 0;
  if (!in.ReadVarintSizeAsInt(&len)) return false;
  const int at = in.CurrentPosition();
  if (len > size - at) return false;
  *span = absl::string_view(data + at, static_cast<size_t>(len));
  return in.Skip(len);
}

// Copies the fields of a Tensor message to `out`, with raw_contents written empty and its bytes
// recorded in `*bulk`. Follows the oneof as protobuf does: the last contents field seen wins.
bool CopyTensor(absl::string_view tensor, std::string* out,
                std::optional<absl::string_view>* bulk) {
  const int size = static_cast<int>(tensor.size());
  CodedInputStream in(reinterpret_cast<const uint8_t*>(tensor.data()), size);
  StringOutputStream sink(out);
  CodedOutputStream os(&sink);
  while (in.CurrentPosition() < size) {
    uint32_t tag = 0;
    if (!ReadTag(in, &tag)) return false;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    if (field == v1::Tensor::kRawContentsFieldNumber && IsLengthDelimited(tag)) {
      absl::string_view bytes;
      if (!ReadSpan(in, tensor.data(), size, &bytes)) return false;
      *bulk = bytes;
      os.WriteTag(tag);
      os.WriteVarint32(0);
      continue;
    }
    if ((field == v1::Tensor::kShmFieldNumber || field == v1::Tensor::kCudaIpcFieldNumber) &&
        IsLengthDelimited(tag)) {
      bulk->reset();
    }
    if (!WireFormatLite::SkipField(&in, tag, &os)) return false;
  }
  return !os.HadError();
}

// ParseRequestInPlace's walk; `bulk` may be half filled when it fails.
bool Walk(absl::string_view wire, v1::VerifyRequest* req, InPlaceTensors* bulk) {
  if (wire.size() > static_cast<size_t>(INT_MAX)) return false;
  const int size = static_cast<int>(wire.size());
  std::string small;  // the message without the bulk
  {
    CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()), size);
    StringOutputStream sink(&small);
    CodedOutputStream os(&sink);
    std::string tensor;
    while (in.CurrentPosition() < size) {
      uint32_t tag = 0;
      if (!ReadTag(in, &tag)) return false;
      const int field = WireFormatLite::GetTagFieldNumber(tag);
      std::optional<absl::string_view>* into =
          !IsLengthDelimited(tag)                           ? nullptr
          : field == v1::VerifyRequest::kQFieldNumber      ? &bulk->q
          : field == v1::VerifyRequest::kKvPoolFieldNumber ? &bulk->kv_pool
                                                           : nullptr;
      if (into == nullptr) {
        if (!WireFormatLite::SkipField(&in, tag, &os)) return false;
        continue;
      }
      absl::string_view sub;
      if (!ReadSpan(in, wire.data(), size, &sub)) return false;
      tensor.clear();
      if (!CopyTensor(sub, &tensor, into)) return false;
      os.WriteTag(tag);
      os.WriteVarint32(static_cast<uint32_t>(tensor.size()));
      os.WriteString(tensor);
    }
    if (os.HadError()) return false;
  }
  return req->ParseFromString(small);
}

}  // namespace

bool ParseRequestInPlace(absl::string_view wire, v1::VerifyRequest* req, InPlaceTensors* bulk) {
  *bulk = InPlaceTensors();
  if (Walk(wire, req, bulk)) return true;
  *bulk = InPlaceTensors();
  return false;
}

}  // namespace verifyd
