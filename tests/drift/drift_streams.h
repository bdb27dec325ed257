#pragma once
// Oracle samples from the real CPU engine: for a fresh random bundle per call, the rel-L2 of
// custom and of the reference against the fp64 oracle, as verifyd's handler records them.

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "src/bundle/random_bundle.h"
#include "src/compare/compare.h"
#include "src/cpu_engine/cpu_engine.h"

namespace verifyd::testing {

struct OracleSample {
  double custom_vs_oracle = 0, reference_vs_oracle = 0;
};

// `calls` oracle samples of one shape class; seeds seed, seed+1, ...
inline std::vector<OracleSample> OracleStream(Engine& engine, RandomBundleSpec spec, int calls) {
  std::vector<OracleSample> out;
  const uint64_t seed0 = spec.seed;
  for (int i = 0; i < calls; ++i) {
    spec.seed = seed0 + static_cast<uint64_t>(i);
    RandomBundle bundle(spec);
    auto b = engine.Prepare(bundle.view(), false);
    if (!b.ok()) return {};
    for (Path p : {Path::kReference, Path::kCustom, Path::kOracle}) {
      if (!engine.Run(p, **b).ok()) return {};
    }
    auto c = engine.Compare(**b, Path::kCustom, Path::kOracle, Tolerance{});
    auto r = engine.Compare(**b, Path::kReference, Path::kOracle, Tolerance{});
    if (!c.ok() || !r.ok()) return {};
    out.push_back({c->rel_l2, r->rel_l2});
  }
  return out;
}

}  // namespace verifyd::testing
