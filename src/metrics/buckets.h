#pragma once
// Histogram bucket edges that are exact decimals.
//
// Each edge is the double nearest to a short decimal (mantissa x 10^exponent, parsed from its
// decimal text), so the exposition's `le` label prints as that decimal ("0.01", never
// "0.009999999999999979") and a PromQL matcher such as le="0.01" finds it. prometheus-cpp
// prints 16 significant digits, which for a few decimals shows the double's error (0.0006 as
// "0.0005999999999999999"); the mantissas below avoid those in the decades they are used in,
// and test_metrics checks every label.

#include <vector>

namespace verifyd {

// One decade's edges as mantissas in hundredths: {100, 250} is 1 and 2.5 times 10^k.
using DecadeMantissas = std::vector<int>;

// The edges m/100 x 10^k for every k in [from_exp, to_exp) and every m, then 10^to_exp.
std::vector<double> DecimalEdges(int from_exp, int to_exp, const DecadeMantissas& hundredths);

// Server and path times: 1-2-5 from 10 us to 100 s.
std::vector<double> LatencyBuckets();

// Differences between two outputs (relative L2, largest absolute element difference), from
// 10^from_exp to 10^to_exp. Ten edges per decade between 1e-4 and 1e-1, where the default
// tolerances and the noise floor of the pairs sit: the preferred numbers R'10 (1, 1.25, 1.6, 2,
// 2.5, 3.2, 4, 5, 6.3, 8), evenly spaced in log. Four per decade elsewhere (1, 2, 2.5, 5). Every
// default tolerance (atol 0.01, rtol 0.02, max_rel_l2 0.01, max_abs 0.25), and 1e-4 (the lse limit
// docs/detection.md derives), is an edge.
std::vector<double> DiffBuckets(int from_exp, int to_exp);

}  // namespace verifyd
