#pragma once
// The daemon's values as verifyd.v1 messages and gRPC statuses: every conversion between the
// C++ types and the protocol lives here, for the data plane and the admin service alike.

#include <optional>

#include "grpcpp/support/status.h"
#include "src/capture/capturer.h"
#include "src/compare/compare.h"
#include "src/control/mode.h"
#include "src/control/mode_controller.h"
#include "src/engine/engine.h"
#include "src/probe/probe_scheduler.h"
#include "src/region/region_registry.h"
#include "src/server/runtime_facts.h"
#include "verifyd/v1/admin.pb.h"
#include "verifyd/v1/types.pb.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

// The absl code and message as a gRPC status (the two enums share their values).
grpc::Status ToGrpc(const absl::Status& st);

// Mode <-> verifyd.v1.Mode: the proto enum is the C++ one shifted past MODE_UNSPECIFIED.
inline v1::Mode ModeToProto(Mode m) { return static_cast<v1::Mode>(static_cast<int>(m) + 1); }
// nullopt for MODE_UNSPECIFIED or an unknown value.
inline std::optional<Mode> ModeFromProto(v1::Mode m) {
  if (m < v1::MODE_REFERENCE || m > v1::MODE_CUSTOM) return std::nullopt;
  return static_cast<Mode>(static_cast<int>(m) - 1);
}

v1::PathKind PathToProto(Path p);
// A custom-vs-reference comparison and its verdict, as a response carries it.
void FillComparison(const DiffStats& d, const Verdict& v, v1::Comparison* c);
// A registry entry as the protocol shows it (ListRegions, the admin status).
void ToProto(const RegionSummary& s, v1::RegionInfo* out);
void ToProto(const RegionSetSummary& s, v1::RegionSetInfo* out);
// The admin status's sections.
void FillRuntime(const RuntimeFacts& f, v1::RuntimeConfig* out);
void FillDrift(const DriftStatus& d, v1::DriftStatus* out);
void FillProbe(const ProbeScheduler* p, v1::ProbeStatus* out);  // null: left empty
void FillCapture(const Capturer* c, v1::CaptureStatus* out);    // null: left empty

}  // namespace verifyd
