#include "src/cpu_engine/cpu_custom.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "src/common/bf16.h"
#include "src/cpu_engine/call_poll.h"
#include "src/cpu_engine/softmax_state.h"

namespace verifyd {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float DotF32(const float* a, const float* b) {
  float acc[8] = {};
  for (int k = 0; k < kHeadDimQK; k += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += a[k + u] * b[k + u];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// One KV split's result for the M = T * heads rows of a request: normalized o and its lse.
struct Partial {
  std::vector<float> o;             // [M, 512]
  std::vector<SoftmaxState> state;  // [M]
};

// The rows of a request: row r = i * nh + (h - h0), token-major like the kernel's M dimension.
struct RowBlock {
  const BundleView* v;
  int b, h0, nh, rows;
  int64_t kv_len, prefix;
  std::vector<float> q;     // [rows, 576]
  const CallContext* call;  // null: never abandoned
  bool pv_bf16 = false;     // CpuCustomConfig::pv_bf16
};

bool Abandoned(const RowBlock& rb) { return rb.call != nullptr && rb.call->Abandoned(); }

// Attention of every row over KV tokens [t_begin, t_end), tile by tile.
Partial RunSplit(const RowBlock& rb, int64_t t_begin, int64_t t_end, int tile) {
  const BundleView& v = *rb.v;
  const int M = rb.rows;
  Partial part;
  part.o.assign(int64_t{M} * kHeadDimV, 0.f);
  part.state.assign(M, SoftmaxState{});

  std::vector<float> k_tile(int64_t{tile} * kHeadDimQK);
  std::vector<float> s(tile), p_bf16(tile);
  CallPoll poll(rb.call);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += tile) {
    const int n = static_cast<int>(std::min<int64_t>(tile, t_end - t0));
    for (int k = 0; k < n; ++k) {
      const uint16_t* src = v.KvRow(rb.b, t0 + k);
      float* dst = k_tile.data() + int64_t{k} * kHeadDimQK;
      for (int d = 0; d < kHeadDimQK; ++d) dst[d] = Bf16ToFloat(src[d]);
    }
    const bool covers_tail = t0 + n > rb.prefix;
    for (int r = 0; r < M; ++r) {
      // A tile carries T * heads rows (up to 128K): check between rows, not only between tiles.
      if (poll.Abandoned(int64_t{n} * (kHeadDimQK + kHeadDimV))) return part;
      const int i = r / rb.nh;
      const float* qr = rb.q.data() + int64_t{r} * kHeadDimQK;
      SoftmaxState tile_state;
      for (int k = 0; k < n; ++k) {
        const int64_t t = t0 + k;
        const bool seen =
            !covers_tail || t < rb.prefix || v.MaskBit(rb.b, i, static_cast<int>(t - rb.prefix));
        s[k] = seen ? DotF32(qr, k_tile.data() + int64_t{k} * kHeadDimQK) * v.sm_scale : kNegInf;
        tile_state.m = std::max(tile_state.m, s[k]);
      }
      if (tile_state.m == kNegInf) continue;  // the row sees nothing in this tile
      for (int k = 0; k < n; ++k) {
        const float p = std::exp(s[k] - tile_state.m);  // exp(-inf) = 0 for masked keys
        tile_state.d += p;
        p_bf16[k] = RoundToBf16(p);  // the tensor cores take P in bf16
      }
      const SoftmaxState::Scales sc = part.state[r].Merge(tile_state);
      float* acc = part.o.data() + int64_t{r} * kHeadDimV;
      if (sc.self != 1.f) {
        for (int d = 0; d < kHeadDimV; ++d) acc[d] *= sc.self;
      }
      for (int k = 0; k < n; ++k) {
        const float w = p_bf16[k] * sc.other;
        if (w == 0.f) continue;
        const float* vk = k_tile.data() + int64_t{k} * kHeadDimQK;
        for (int d = 0; d < kHeadDimV; ++d) acc[d] += w * vk[d];
        if (rb.pv_bf16) {
          for (int d = 0; d < kHeadDimV; ++d) acc[d] = RoundToBf16(acc[d]);
        }
      }
    }
  }
  // Normalize: the split's output is softmax-weighted, and its state carries lse = m + log(d).
  for (int r = 0; r < M; ++r) {
    SoftmaxState& st = part.state[r];
    if (st.empty()) continue;
    const float inv = 1.f / st.d;
    float* acc = part.o.data() + int64_t{r} * kHeadDimV;
    for (int d = 0; d < kHeadDimV; ++d) acc[d] *= inv;
    st = SoftmaxState{st.Lse(), 1.f};
  }
  return part;
}

}  // namespace

void CustomRequestHeads(const BundleView& v, int b, int h0, int h1, const CpuCustomConfig& c,
                        uint16_t* o, float* lse, const CallContext* call) {
  const int T = v.shape.draft, H = v.shape.heads;
  RowBlock rb{&v, b,    h0,       h1 - h0, T * (h1 - h0), v.kv_lens[b], v.kv_lens[b] - T,
              {}, call, c.pv_bf16};
  rb.q.resize(int64_t{rb.rows} * kHeadDimQK);
  for (int i = 0; i < T; ++i) {
    for (int h = h0; h < h1; ++h) {
      const uint16_t* src = v.q + ((int64_t{b} * T + i) * H + h) * kHeadDimQK;
      float* dst = rb.q.data() + (int64_t{i} * rb.nh + (h - h0)) * kHeadDimQK;
      for (int d = 0; d < kHeadDimQK; ++d) dst[d] = Bf16ToFloat(src[d]);
    }
  }

  // Plan the KV split as the kernel does: at most max_splits chunks of whole tiles.
  const int tile = std::max(1, c.tile_tokens);
  const int max_splits = std::max(1, c.max_splits);
  int64_t chunk = std::max<int64_t>(c.min_chunk_tokens, (rb.kv_len + max_splits - 1) / max_splits);
  chunk = std::max<int64_t>(tile, (chunk + tile - 1) / tile * tile);
  if (c.force_splits > 0) {  // the invariance probes' fixed plans: ceil(tiles / splits) tiles each
    const int64_t tiles = std::max<int64_t>(1, (rb.kv_len + tile - 1) / tile);
    chunk = (tiles + c.force_splits - 1) / c.force_splits * tile;
  }

  // Merge the splits' partials by log-sum-exp, in split order.
  std::vector<float> out(int64_t{rb.rows} * kHeadDimV, 0.f);
  std::vector<SoftmaxState> merged(rb.rows);
  for (int64_t t0 = 0; t0 < rb.kv_len; t0 += chunk) {
    if (Abandoned(rb)) return;
    const Partial part = RunSplit(rb, t0, std::min(rb.kv_len, t0 + chunk), tile);
    for (int r = 0; r < rb.rows; ++r) {
      const SoftmaxState::Scales sc = merged[r].Merge(part.state[r]);
      float* acc = out.data() + int64_t{r} * kHeadDimV;
      const float* po = part.o.data() + int64_t{r} * kHeadDimV;
      for (int d = 0; d < kHeadDimV; ++d) acc[d] = acc[d] * sc.self + po[d] * sc.other;
    }
  }

  for (int r = 0; r < rb.rows; ++r) {
    const int i = r / rb.nh, h = h0 + r % rb.nh;
    const int64_t row = (int64_t{b} * T + i) * H + h;
    // Merged weights sum to d (not 1) once splits share a max; divide it out.
    // o_scale: an e4m3 pool's kv_scale, applied to V's sum before the rounding (DequantizedBundle).
    const float inv = merged[r].empty() ? 0.f : v.o_scale / merged[r].d;
    const float* acc = out.data() + int64_t{r} * kHeadDimV;
    uint16_t* dst = o + row * kHeadDimV;
    for (int d = 0; d < kHeadDimV; ++d) dst[d] = FloatToBf16(acc[d] * inv);
    if (lse != nullptr) lse[row] = merged[r].Lse();
  }
}

void RunCustom(const BundleView& v, const CpuCustomConfig& c, std::vector<uint16_t>* o,
               std::vector<float>* lse) {
  o->assign(v.o_elems(), 0);
  lse->assign(v.lse_elems(), 0.f);
  for (int b = 0; b < v.shape.batch; ++b) {
    CustomRequestHeads(v, b, 0, v.shape.heads, c, o->data(), lse->data());
  }
}

}  // namespace verifyd
