#include "src/cpu_engine/cpu_oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "src/common/bf16.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

// Heads per pass: bounds the score buffer ([heads, kv_len] doubles) on long prefixes.
constexpr int kOracleHeadGroup = 16;
// Keys between two polls of the call: a poll on every key slowed the passes by a quarter.
constexpr int64_t kKeysPerPoll = 64;

void ToDouble(const uint16_t* src, int n, double* dst) {
  for (int k = 0; k < n; ++k) dst[k] = Bf16ToFloat(src[k]);
}

// Token t's first n dims, from a bf16 or an e4m3 pool (e4m3 x kv_scale in fp32).
void KvToDouble(const BundleView& v, int b, int64_t t, int n, float* scratch, double* dst) {
  v.KvRowFloat(b, t, n, scratch);
  for (int k = 0; k < n; ++k) dst[k] = scratch[k];
}

double Dot(const double* a, const double* b, int n) {
  double acc[4] = {0, 0, 0, 0};
  for (int k = 0; k < n; k += 4) {
    for (int u = 0; u < 4; ++u) acc[u] += a[k + u] * b[k + u];
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// False when `poll` saw the call abandoned (o and lse then incomplete).
bool OracleHeadGroup(const BundleView& v, int b, int i, int h0, int h1, double* o, double* lse,
                     CallPoll& poll) {
  const int T = v.shape.draft, H = v.shape.heads;
  const int nh = h1 - h0;
  const int64_t kv_len = v.kv_lens[b];
  const int64_t prefix = kv_len - T;
  const double scale = v.sm_scale;

  std::vector<double> q(int64_t{nh} * kHeadDimQK);
  const uint16_t* q_src = v.q + ((int64_t{b} * T + i) * H + h0) * kHeadDimQK;
  ToDouble(q_src, nh * kHeadDimQK, q.data());

  std::vector<int64_t> visible;
  visible.reserve(kv_len);
  for (int64_t t = 0; t < kv_len; ++t) {
    if (t < prefix || v.MaskBit(b, i, static_cast<int>(t - prefix))) visible.push_back(t);
  }
  const int64_t n = static_cast<int64_t>(visible.size());
  std::fill(o, o + int64_t{nh} * kHeadDimV, 0.0);
  if (n == 0) {
    std::fill(lse, lse + nh, -std::numeric_limits<double>::infinity());
    return true;
  }

  // Pass 1: scaled scores and their max per head.
  std::vector<double> s(nh * n), row(kHeadDimQK);
  float scratch[kHeadDimQK];
  std::vector<double> mx(nh, -std::numeric_limits<double>::infinity());
  for (int64_t k = 0; k < n; ++k) {
    if (k % kKeysPerPoll == 0 && poll.Abandoned(kKeysPerPoll * nh * kHeadDimQK)) return false;
    KvToDouble(v, b, visible[k], kHeadDimQK, scratch, row.data());
    for (int h = 0; h < nh; ++h) {
      const double x = scale * Dot(q.data() + int64_t{h} * kHeadDimQK, row.data(), kHeadDimQK);
      s[h * n + k] = x;
      mx[h] = std::max(mx[h], x);
    }
  }
  // Pass 2: exp(s - max), their sum and the weighted sum of V.
  std::vector<double> den(nh, 0.0);
  for (int64_t k = 0; k < n; ++k) {
    if (k % kKeysPerPoll == 0 && poll.Abandoned(kKeysPerPoll * nh * kHeadDimV)) return false;
    KvToDouble(v, b, visible[k], kHeadDimV, scratch, row.data());
    for (int h = 0; h < nh; ++h) {
      const double p = std::exp(s[h * n + k] - mx[h]);
      den[h] += p;
      double* oh = o + int64_t{h} * kHeadDimV;
      for (int d = 0; d < kHeadDimV; ++d) oh[d] += p * row[d];
    }
  }
  for (int h = 0; h < nh; ++h) {
    double* oh = o + int64_t{h} * kHeadDimV;
    for (int d = 0; d < kHeadDimV; ++d) oh[d] /= den[h];
    lse[h] = mx[h] + std::log(den[h]);
  }
  return true;
}

}  // namespace

bool OracleTokenHeads(const BundleView& v, int b, int i, int h0, int h1, double* o, double* lse,
                      CallPoll* poll) {
  CallPoll never(nullptr);
  for (int g = h0; g < h1; g += kOracleHeadGroup) {
    const int g1 = std::min(h1, g + kOracleHeadGroup);
    if (!OracleHeadGroup(v, b, i, g, g1, o + int64_t{g - h0} * kHeadDimV, lse + (g - h0),
                         poll != nullptr ? *poll : never)) {
      return false;
    }
  }
  return true;
}

void OracleRequestHeads(const BundleView& v, int b, int h0, int h1, double* o, double* lse,
                        const CallContext* call) {
  const int T = v.shape.draft, H = v.shape.heads;
  CallPoll poll(call);
  for (int i = 0; i < T; ++i) {
    const int64_t row = (int64_t{b} * T + i) * H + h0;
    if (!OracleTokenHeads(v, b, i, h0, h1, o + row * kHeadDimV, lse + row, &poll)) return;
  }
}

void RunOracle(const BundleView& v, std::vector<double>* o, std::vector<double>* lse) {
  o->assign(v.o_elems(), 0.0);
  lse->assign(v.lse_elems(), 0.0);
  for (int b = 0; b < v.shape.batch; ++b) {
    OracleRequestHeads(v, b, 0, v.shape.heads, o->data(), lse->data());
  }
}

}  // namespace verifyd
