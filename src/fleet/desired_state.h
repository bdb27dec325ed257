#pragma once
// A fleet's desired state, as a rollout controller writes it for every node to read (a
// Kubernetes ConfigMap's JSON file; docs/operations.md, "Fleets"):
//
//   {"generation": 7, "mode": "canary", "canary_fraction": 0.1, "build": "0123456789ab",
//    "step": {"fraction": 0.25}, "stable_mode": "shadow", "reason": "rollout r3, step 2"}
//
// Nodes in the step are asked for `mode`; the others for `stable_mode` (shadow when absent). A
// step names its nodes by a fraction of the node-name hash space (the same nodes at every node
// and in the controller, a fraction's nodes inside any larger fraction's) or by name; no step
// means every node. `build`, when given, is the build the state applies to: another build's node
// refuses it. `generation` orders the states: a node applies each generation once, so that a
// node its own gate rolled back is not flipped again until the fleet asks anew.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "src/control/mode.h"

namespace verifyd::fleet {

struct DesiredState {
  int64_t generation = 0;  // >= 1
  Mode mode = Mode::kShadow;
  double canary_fraction = 0;           // canary only, in (0, 1]
  std::string build;                    // empty: any build
  std::optional<double> step_fraction;  // in [0, 1]
  std::vector<std::string> step_nodes;  // with no fraction: these nodes; neither: every node
  Mode stable_mode = Mode::kShadow;     // for the nodes outside the step; never canary/custom
  std::string reason;
};

// INVALID_ARGUMENT naming the field for anything else than the format above; unknown fields are
// refused (a typo must not pass for a default).
absl::StatusOr<DesiredState> ParseDesiredState(std::string_view json);
// The canonical JSON of `s` (ParseDesiredState reads it back to the same state).
std::string SerializeDesiredState(const DesiredState& s);

// Where `node` falls in the node-name hash space, in [0, 1): FNV-1a (64 bits) of the name, then
// MurmurHash3's 64-bit finalizer (fmix64), its top 53 bits. Changing it moves nodes between
// steps: the controller and every node must compute the same.
double NodeHashFraction(std::string_view node);
bool InStep(const DesiredState& s, std::string_view node);

// What the state asks of `node`: the step's mode (and canary fraction) or the stable mode.
struct NodeTarget {
  Mode mode = Mode::kShadow;
  double canary_fraction = 0;
};
NodeTarget TargetFor(const DesiredState& s, std::string_view node);

}  // namespace verifyd::fleet
