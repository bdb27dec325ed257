// Measures what the oracle drift test sees on the CPU engine: per shape class and traffic model,
// the distribution of x = ln(custom_vs_oracle / reference_vs_oracle) for the clean custom path
// and for the custom path with its P·V accumulator rounded to bf16 (--inject_custom_fault
// bf16_pv). The README's derivation of the drift defaults quotes its output.
//
//   drift_calibration [--calls N] [--prefixes 512,4096] [--threads N]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "fmt/format.h"
#include "src/control/drift_test.h"
#include "tests/drift/drift_streams.h"

namespace {

struct Summary {
  double mean = 0, sd = 0, min = 0, max = 0, c_mean = 0, r_mean = 0;
};

Summary Summarize(const std::vector<verifyd::testing::OracleSample>& s, double floor) {
  Summary out;
  std::vector<double> x;
  for (const auto& o : s) {
    x.push_back(std::log((o.custom_vs_oracle + floor) / (o.reference_vs_oracle + floor)));
    out.c_mean += o.custom_vs_oracle / s.size();
    out.r_mean += o.reference_vs_oracle / s.size();
  }
  for (double v : x) out.mean += v / x.size();
  for (double v : x) out.sd += (v - out.mean) * (v - out.mean);
  out.sd = x.size() > 1 ? std::sqrt(out.sd / (x.size() - 1)) : 0;
  out.min = *std::min_element(x.begin(), x.end());
  out.max = *std::max_element(x.begin(), x.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace verifyd;
  CLI::App app{"oracle drift calibration on the CPU engine"};
  int calls = 64, threads = 2;
  std::vector<int64_t> prefixes{512, 4096};
  app.add_option("--calls", calls)->capture_default_str();
  app.add_option("--prefixes", prefixes)->delimiter(',');
  app.add_option("--threads", threads)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const DriftOptions d;
  std::printf(
      "| fault | traffic | prefix | page | T | calls | c mean | r mean | ln ratio mean | sd "
      "| min | max | drift samples to breach "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (bool faulty : {false, true}) {
    auto engine = MakeCpuEngine(threads);
    if (faulty) engine->InjectCustomFault({CustomFault::Kind::kBf16Pv, 0});
    for (Traffic traffic : {Traffic::kRandom, Traffic::kRealistic}) {
      for (int64_t prefix : prefixes) {
        for (int page : {1, 64}) {
          for (int draft : {4, 16}) {
            RandomBundleSpec spec;
            spec.batch = 1;
            spec.heads = 8;
            spec.draft = draft;
            spec.prefix = prefix;
            spec.page_size = page;
            spec.traffic = traffic;
            spec.seed = 1000;
            const auto s = testing::OracleStream(*engine, spec, calls);
            if (s.empty()) return 1;
            DriftTest test(d);
            int first = -1, breaches = 0;
            for (size_t i = 0; i < s.size(); ++i) {
              if (test.Add(s[i].custom_vs_oracle, s[i].reference_vs_oracle).breach) {
                ++breaches;
                if (first < 0) first = static_cast<int>(i) + 1;
              }
            }
            const Summary m = Summarize(s, d.floor);
            std::printf(
                "| %s | %s | %lld | %d | %d | %d | %.3g | %.3g | %.3f | %.3f | %.3f | %.3f "
                "| %s |\n",
                faulty ? "bf16_pv" : "clean", TrafficName(traffic), static_cast<long long>(prefix),
                page, draft, calls, m.c_mean, m.r_mean, m.mean, m.sd, m.min, m.max,
                first < 0 ? "never"
                          : fmt::format("{} ({} of {} in breach)", first, breaches, calls).c_str());
            std::fflush(stdout);
          }
        }
      }
    }
  }
  return 0;
}
