#include "kernels/custom/custom_plan.h"

#include <algorithm>
#include <cstdint>

namespace verifyd::kernels {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rough cost of one split choice, in units of one CTA working one KV tile: waves of CTAs times
// tiles per CTA (plus one tile's worth for the Q load and epilogue), plus the partial (o, lse)
// traffic of the combine step expressed in the same unit.
double SplitCost(int64_t ctas_base, int64_t max_tiles, int splits, int64_t slots, int64_t rows,
                 double bytes_per_tile_time) {
  const int64_t chunk = CeilDiv(max_tiles, splits);
  const int64_t waves = CeilDiv(ctas_base * splits, slots);
  double cost = static_cast<double>(waves) * static_cast<double>(chunk + 1);
  if (splits > 1) {
    const double partial_bytes = static_cast<double>(rows) * splits * (kHeadDimV + 1) * 4 * 2;
    cost += partial_bytes / bytes_per_tile_time;
  }
  return cost;
}

}  // namespace

CustomPlan PlanCustom(const VerifyProblem& p, bool small_tiles, int num_sms, int ctas_per_sm,
                      int force_splits) {
  CustomPlan plan;
  plan.schedule = small_tiles ? CustomSchedule::kSmallTiles : CustomSchedule::kV5t;
  plan.tiles = small_tiles ? Sm120TileShape() : HopperTileShape();
  const int64_t m = int64_t{p.shape.draft} * p.shape.heads;
  const int64_t rows_total = m * p.shape.batch;
  plan.row_blocks = static_cast<int>(CeilDiv(m, plan.tiles.rows));
  plan.max_tiles = std::max<int64_t>(1, CeilDiv(p.max_kv_len, plan.tiles.tokens));

  const int64_t ctas_base = int64_t{p.shape.batch} * plan.row_blocks;
  const int64_t slots = int64_t{std::max(1, num_sms)} * std::max(1, ctas_per_sm);
  int splits = 1;
  if (force_splits > 0) {
    splits = static_cast<int>(std::min<int64_t>(force_splits, plan.max_tiles));
  } else {
    // One tile of the big configuration takes ~2.5 us on an H200 SM; the partials move at
    // ~3 TB/s: ~7.5 MB per tile-time. The small configuration's tile is ~1/8 of the work.
    const double bytes_per_tile_time = small_tiles ? 1.0e6 : 7.5e6;
    const int max_splits = static_cast<int>(std::min<int64_t>(plan.max_tiles, 256));
    double best = SplitCost(ctas_base, plan.max_tiles, 1, slots, rows_total, bytes_per_tile_time);
    for (int s = 2; s <= max_splits; ++s) {
      const double c =
          SplitCost(ctas_base, plan.max_tiles, s, slots, rows_total, bytes_per_tile_time);
      if (c < best * 0.98) {
        best = c;
        splits = s;
      }
    }
  }
  plan.tiles_per_split = CeilDiv(plan.max_tiles, splits);
  plan.splits = static_cast<int>(CeilDiv(plan.max_tiles, plan.tiles_per_split));
  if (plan.splits > 1) {
    const size_t o_bytes = size_t(plan.splits) * rows_total * kHeadDimV * sizeof(float);
    plan.partial_lse_offset = (o_bytes + 255) / 256 * 256;
    plan.workspace_bytes =
        plan.partial_lse_offset + size_t(plan.splits) * rows_total * sizeof(float);
  }
  return plan;
}

}  // namespace verifyd::kernels
