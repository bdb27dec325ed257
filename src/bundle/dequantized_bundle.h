#pragma once
// An e4m3 pool seen as bf16: the reference and custom paths' reading of an fp8 KV cache (README.md,
// "FP8 KV caches"). The pages the bundle names become a compact bf16 pool (the pages in
// kv_indices' order, renumbered 0, 1, ..., as OwnedBundle's copy of a shared pool) of the e4m3
// values themselves, which bf16 holds exactly; the scale moves out of the pool, into the logits
// (sm_scale x kv_scale) and onto o before its rounding (BundleView::o_scale), as fp8 attention
// kernels apply it. So nothing is rounded that the fp32 oracle (BundleView::KvRowFloat) does not
// round too, at any scale: q.(s k) = s (q.k), and sum p (s v) = s (sum p v).

#include <cstdint>
#include <vector>

#include "src/bundle/bundle.h"

namespace verifyd {

class DequantizedBundle {
 public:
  // v: validated, on the host, with an e4m3 pool. The view shares v's q, lengths and mask, so v's
  // memory must outlive this.
  explicit DequantizedBundle(const BundleView& v);
  DequantizedBundle(const DequantizedBundle&) = delete;
  DequantizedBundle& operator=(const DequantizedBundle&) = delete;
  const BundleView& view() const { return view_; }

  // The bytes the bf16 copy takes.
  static int64_t BytesFor(const BundleView& v);

 private:
  std::vector<uint16_t> pool_;
  std::vector<int32_t> indices_;
  BundleView view_;
};

}  // namespace verifyd
