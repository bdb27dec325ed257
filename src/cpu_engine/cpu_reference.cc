#include "src/cpu_engine/cpu_reference.h"

#include "src/common/bf16.h"
#include "src/cpu_engine/cpu_oracle.h"

namespace verifyd {

void ReferenceRequestHeads(const BundleView& v, int b, int h0, int h1, uint16_t* o, float* lse,
                           const CallContext* call) {
  using kernels::kHeadDimV;
  const int T = v.shape.draft, H = v.shape.heads;
  const int nh = h1 - h0;
  std::vector<double> o_row(int64_t{nh} * kHeadDimV), lse_row(nh);
  // One poll for the whole block: the work of short tokens adds up to a check too.
  CallPoll poll(call);
  for (int i = 0; i < T; ++i) {
    if (!OracleTokenHeads(v, b, i, h0, h1, o_row.data(), lse_row.data(), &poll)) return;
    const int64_t row = (int64_t{b} * T + i) * H + h0;
    uint16_t* dst = o + row * kHeadDimV;
    for (int64_t k = 0; k < int64_t{nh} * kHeadDimV; ++k) {
      dst[k] = FloatToBf16(static_cast<float>(o_row[k] * v.o_scale));
    }
    if (lse != nullptr) {
      for (int h = 0; h < nh; ++h) lse[row + h] = static_cast<float>(lse_row[h]);
    }
  }
}

void RunReference(const BundleView& v, std::vector<uint16_t>* o, std::vector<float>* lse) {
  o->assign(v.o_elems(), 0);
  lse->assign(v.lse_elems(), 0.f);
  for (int b = 0; b < v.shape.batch; ++b) {
    ReferenceRequestHeads(v, b, 0, v.shape.heads, o->data(), lse->data());
  }
}

}  // namespace verifyd
