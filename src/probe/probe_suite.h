#pragma once
// The probe suite: synthetic bundles in which one feature of the computation decides the output,
// so that a kernel that gets that feature wrong gets whole output rows wrong, at any prefix
// length. In a dominant-key probe every (draft token, head) query is built from one chosen key
// (q = K[t] * L / (sm_scale * |K[t]|^2), logit L = ln(kv_len) + 10): that key carries > 99.9% of
// the row's weight and the row's output is that key's V. The chosen keys are:
//   draft_positions/{chain,tree}  every draft position (each token's own, then its ancestors:
//                                 tail-heavy attention);
//   page_edges/page{1,64}         the first and last token of every page, pages scattered over
//                                 the pool;
//   split_boundaries              both sides of every 64-token boundary (tiles and KV splits of
//                                 any plan made of whole 64-token tiles) and the last split;
//   prefix/N                      the first, middle and last prefix token and the row's own
//                                 draft token, for prefixes 0, 1, 2^k +- 1 up to max_prefix.
// And without a dominant key:
//   fully_masked_rows             a draft row that sees nothing (output 0, lse -inf);
//   sink_recency/{chain,tree}     attention concentrated on sink and recent tokens and a few
//                                 heavy hitters, like a served model's (Traffic::kRealistic);
//   sm_scale/deepseek_v3          the same at DeepSeek-V3's real softmax scale
//                                 (kDeepSeekV3SmScale, YaRN included); every other probe uses
//                                 1/sqrt(192);
//   kv_e4m3/scale_12.5            the same traffic on an e4m3 pool (kE4m3ProbeKvScale): the
//                                 scale on the logits and on o, and the decode of every code,
//                                 subnormals included. Both paths read the engine's dequantised
//                                 pool, where a fault shows on both alike, so this probe also
//                                 holds each path to the oracle (ProbeBundle::against_oracle).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/bundle/random_bundle.h"

namespace verifyd {

struct ProbeSuiteOptions {
  // Longest prefix of the prefix sweep and of split_boundaries; 0: the engine's default
  // (DefaultProbeMaxPrefix).
  int64_t max_prefix = 0;
  uint64_t seed = 0x9e0be;
};

// The CPU engine's suite runs in seconds (2048); the CUDA engine's covers kernels::kMaxPrefix.
int64_t DefaultProbeMaxPrefix(const std::string& engine);

// INVALID_ARGUMENT naming the flag (probe_max_prefix) when out of range.
absl::Status ValidateProbeSuiteOptions(const ProbeSuiteOptions& o);

// The e4m3 probe's kv_scale: not a power of two, and large enough that the N(0, 1) pool values
// quantise to subnormal codes (magnitudes below 2^-6 x 12.5 = 0.195) about 15% of the time.
inline constexpr float kE4m3ProbeKvScale = 12.5f;

struct ProbeBundle {
  std::string name;     // e.g. "page_edges/page64"
  std::string feature;  // what decides the output, in words
  std::unique_ptr<RandomBundle> bundle;
  // Also judge the reference and the custom path against the oracle (Judge(), the same
  // tolerance), not only against each other: for a fault both paths share.
  bool against_oracle = false;
};

// `o.max_prefix` must be set (not 0).
std::vector<ProbeBundle> BuildProbeSuite(const ProbeSuiteOptions& o);

}  // namespace verifyd
