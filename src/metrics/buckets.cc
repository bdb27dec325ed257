#include "src/metrics/buckets.h"

#include <charconv>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

// The double nearest to hundredths/100 x 10^exp, parsed from its decimal text (from_chars
// rounds correctly and ignores the locale).
double Decimal(int hundredths, int exp) {
  const std::string text = absl::StrCat(hundredths, "e", exp - 2);
  double v = 0;
  if (std::from_chars(text.data(), text.data() + text.size(), v).ec != std::errc()) std::abort();
  return v;
}

const DecadeMantissas kFine = {100, 125, 160, 200, 250, 320, 400, 500, 630, 800};
const DecadeMantissas kCoarse = {100, 200, 250, 500};
constexpr int kFineFrom = -4, kFineTo = -1;

}  // namespace

std::vector<double> DecimalEdges(int from_exp, int to_exp, const DecadeMantissas& hundredths) {
  std::vector<double> edges;
  for (int k = from_exp; k < to_exp; ++k) {
    for (int m : hundredths) edges.push_back(Decimal(m, k));
  }
  edges.push_back(Decimal(100, to_exp));
  return edges;
}

std::vector<double> LatencyBuckets() { return DecimalEdges(-5, 2, {100, 200, 500}); }

std::vector<double> DiffBuckets(int from_exp, int to_exp) {
  std::vector<double> edges;
  for (int k = from_exp; k < to_exp; ++k) {
    const bool fine = k >= kFineFrom && k < kFineTo;
    std::vector<double> decade = DecimalEdges(k, k + 1, fine ? kFine : kCoarse);
    edges.insert(edges.end(), decade.begin(), decade.end() - 1);
  }
  edges.push_back(Decimal(100, to_exp));
  return edges;
}

}  // namespace verifyd
