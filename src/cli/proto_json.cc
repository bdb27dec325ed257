#include "src/cli/proto_json.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "google/protobuf/descriptor.h"

namespace verifyd::cli {
namespace {

using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using nlohmann::json;

// The prefix every value of the enum shares, up to an underscore ("MODE_", "REGION_KIND_").
size_t CommonPrefix(const EnumDescriptor* e) {
  std::string p = e->value(0)->name();
  for (int i = 1; i < e->value_count(); ++i) {
    const std::string& n = e->value(i)->name();
    size_t k = 0;
    while (k < p.size() && k < n.size() && p[k] == n[k]) ++k;
    p.resize(k);
  }
  const size_t cut = p.rfind('_');
  return cut == std::string::npos ? 0 : cut + 1;
}

json EnumName(const EnumValueDescriptor* v) {
  return absl::AsciiStrToLower(v->name().substr(CommonPrefix(v->type())));
}

json Number(double v) { return std::isfinite(v) ? json(v) : json(); }

json Scalar(const Message& m, const Reflection* r, const FieldDescriptor* f, int i) {
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Number(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Number(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return EnumName(rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f));
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f));
  }
  return json();
}

}  // namespace

json ProtoToJson(const Message& m) {
  const Reflection* r = m.GetReflection();
  const auto* d = m.GetDescriptor();
  json out = json::object();
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    if (f->is_repeated()) {
      json a = json::array();
      for (int i = 0; i < r->FieldSize(m, f); ++i) a.push_back(Scalar(m, r, f, i));
      out[f->name()] = std::move(a);
    } else {
      out[f->name()] = Scalar(m, r, f, 0);
    }
  }
  return out;
}

}  // namespace verifyd::cli
