#include "src/bundle/request_in_place.h"

#include <climits>
#include <cstdint>
#include <string>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace verifyd {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

// Every byte that is not rewritten is copied as sent, so that protobuf's own parse of the copy
// judges it (over-long varints, bad UTF-8, nesting too deep) exactly as it judges the original.
// What is rewritten (the length of q and kv_pool, raw_contents emptied) is read under protobuf's
// parser's rules first.

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

// Reads a length-delimited field's length after its tag as protobuf's parser reads a size (at
// most five bytes, below 2^31 - 16: its ReadSize), and the bytes it spans in `data`.
bool ReadSpan(CodedInputStream& in, const char* data, int size, absl::string_view* span) {
  const int at = in.CurrentPosition();
  uint64_t len = 0;
  if (!in.ReadVarint64(&len) || in.CurrentPosition() - at > 5 || len > INT_MAX - 16) return false;
  const int from = in.CurrentPosition();
  if (len > static_cast<uint64_t>(size - from)) return false;
  *span = absl::string_view(data + from, static_cast<size_t>(len));
  return in.Skip(static_cast<int>(len));
}

// Appends data[from, to) to `out`.
void AppendRange(absl::string_view data, int from, int to, std::string* out) {
  out->append(data.data() + from, static_cast<size_t>(to - from));
}

void AppendVarint(uint32_t v, std::string* out) {
  uint8_t buf[5];
  const uint8_t* end = CodedOutputStream::WriteVarint32ToArray(v, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

// Skips the field whose tag `in` has just read (the tag starts at `from` in `data`) and appends
// the whole field, tag included, to `out` as sent.
bool CopyField(CodedInputStream& in, uint32_t tag, absl::string_view data, int from,
               std::string* out) {
  if (!WireFormatLite::SkipField(&in, tag)) return false;
  AppendRange(data, from, in.CurrentPosition(), out);
  return true;
}

// Copies the fields of a Tensor message to `out`, with raw_contents written empty and its bytes
// recorded in `*bulk`. Follows the oneof as protobuf does: the last contents field seen wins.
bool CopyTensor(absl::string_view tensor, std::string* out,
                std::optional<absl::string_view>* bulk) {
  const int size = static_cast<int>(tensor.size());
  CodedInputStream in(reinterpret_cast<const uint8_t*>(tensor.data()), size);
  while (in.CurrentPosition() < size) {
    const int at = in.CurrentPosition();
    uint32_t tag = 0;
    if (!ReadTag(in, &tag)) return false;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    if (field == v1::Tensor::kRawContentsFieldNumber && IsLengthDelimited(tag)) {
      absl::string_view bytes;
      AppendRange(tensor, at, in.CurrentPosition(), out);  // the tag
      if (!ReadSpan(in, tensor.data(), size, &bytes)) return false;
      *bulk = bytes;
      out->push_back('\0');
      continue;
    }
    if ((field == v1::Tensor::kShmFieldNumber || field == v1::Tensor::kCudaIpcFieldNumber) &&
        IsLengthDelimited(tag)) {
      bulk->reset();
    }
    if (!CopyField(in, tag, tensor, at, out)) return false;
  }
  return true;
}

// ParseRequestInPlace's walk; `bulk` may be half filled when it fails.
bool Walk(absl::string_view wire, v1::VerifyRequest* req, InPlaceTensors* bulk) {
  if (wire.size() > static_cast<size_t>(INT_MAX)) return false;
  const int size = static_cast<int>(wire.size());
  std::string small;  // the message without the bulk
  CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()), size);
  std::string tensor;
  while (in.CurrentPosition() < size) {
    const int at = in.CurrentPosition();
    uint32_t tag = 0;
    if (!ReadTag(in, &tag)) return false;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    std::optional<absl::string_view>* into = !IsLengthDelimited(tag)                     ? nullptr
                                             : field == v1::VerifyRequest::kQFieldNumber ? &bulk->q
                                             : field == v1::VerifyRequest::kKvPoolFieldNumber
                                                 ? &bulk->kv_pool
                                                 : nullptr;
    if (into == nullptr) {
      if (!CopyField(in, tag, wire, at, &small)) return false;
      continue;
    }
    AppendRange(wire, at, in.CurrentPosition(), &small);  // the tag
    absl::string_view sub;
    if (!ReadSpan(in, wire.data(), size, &sub)) return false;
    tensor.clear();
    if (!CopyTensor(sub, &tensor, into)) return false;
    AppendVarint(static_cast<uint32_t>(tensor.size()), &small);
    small.append(tensor);
  }
  return req->ParseFromString(small);
}

}  // namespace

uint64_t RequestPieces::size() const {
  uint64_t n = small.size();
  for (const Insert& i : bulk) n += i.bytes.size();
  return n;
}

std::vector<absl::string_view> RequestPieces::Pieces() const& {
  std::vector<absl::string_view> out;
  size_t from = 0;
  for (const Insert& i : bulk) {
    if (i.at > from) out.emplace_back(small.data() + from, i.at - from);
    if (!i.bytes.empty()) out.push_back(i.bytes);
    from = i.at;
  }
  if (small.size() > from) out.emplace_back(small.data() + from, small.size() - from);
  return out;
}

RequestPieces SerializeRequestAround(const v1::VerifyRequest& req, const InPlaceTensors& bulk) {
  RequestPieces p;
  req.SerializeToString(&p.small);
  const uint32_t raw_tag = WireFormatLite::MakeTag(v1::Tensor::kRawContentsFieldNumber,
                                                   WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  for (auto [field, bytes] : {std::pair{v1::VerifyRequest::kQFieldNumber, bulk.q},
                              std::pair{v1::VerifyRequest::kKvPoolFieldNumber, bulk.kv_pool}}) {
    if (!bytes) continue;
    // field { raw_contents: bytes }, its bytes not copied.
    const uint32_t n = static_cast<uint32_t>(bytes->size());
    const size_t raw_header =
        CodedOutputStream::VarintSize32(raw_tag) + CodedOutputStream::VarintSize32(n);
    AppendVarint(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                 &p.small);
    AppendVarint(static_cast<uint32_t>(raw_header + n), &p.small);
    AppendVarint(raw_tag, &p.small);
    AppendVarint(n, &p.small);
    p.bulk.push_back({p.small.size(), *bytes});
  }
  return p;
}

bool ParseRequestInPlace(absl::string_view wire, v1::VerifyRequest* req, InPlaceTensors* bulk) {
  *bulk = InPlaceTensors();
  if (Walk(wire, req, bulk)) return true;
  *bulk = InPlaceTensors();
  return false;
}

}  // namespace verifyd
