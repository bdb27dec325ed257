#pragma once
// A protobuf message as JSON for `--json` output, through protobuf's reflection: field names as
// in the .proto, every field present (defaults too), 64-bit integers as numbers, enums by their
// value name without the enum's common prefix (MODE_SHADOW -> "shadow"), NaN and Inf as null.

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace verifyd::cli {

nlohmann::json ProtoToJson(const google::protobuf::Message& m);

}  // namespace verifyd::cli
