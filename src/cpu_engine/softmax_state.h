#pragma once
// Online-softmax statistics of one query row, merged tile by tile and split by split.

#include <algorithm>
#include <cmath>
#include <limits>

namespace verifyd {

// m: running max of the scaled scores, d: sum of exp(s - m). Empty: m = -inf, d = 0.
struct SoftmaxState {
  float m = -std::numeric_limits<float>::infinity();
  float d = 0.f;

  bool empty() const { return d == 0.f; }
  float Lse() const { return empty() ? -std::numeric_limits<float>::infinity() : m + std::log(d); }

  // Folds `other` into this state. Returns the factors by which the accumulators that belong to
  // this state and to `other` must be scaled so both refer to the merged max.
  struct Scales {
    float self = 1.f, other = 1.f;
  };
  Scales Merge(const SoftmaxState& other) {
    // Two empty states: exp(-inf - -inf) would be NaN; nothing to rescale.
    if (other.empty()) return {1.f, 0.f};
    if (empty()) {
      *this = other;
      return {0.f, 1.f};
    }
    const float m_new = std::max(m, other.m);
    Scales s{std::exp(m - m_new), std::exp(other.m - m_new)};
    d = d * s.self + other.d * s.other;
    m = m_new;
    return s;
  }
};

}  // namespace verifyd
