#pragma once
// Invariance probes: the custom path's output must not depend on how it is computed. None of
// these needs the reference; each runs the custom path on one bundle and on the same attention
// computed another way, and compares rows:
//   split_plan   the same bundle under forced KV split counts 1, 2, 3, ... up to its tiles (one
//                count per distinct tiles-per-split, so both parities), and the engine's plan;
//   page_size    the same tokens in pages of 1, 16 and 64;
//   page_order   the pool's pages permuted (page ids follow);
//   batch        each request alone, against the same request at every position of the batch
//                (the batch's rotations);
//   padding      each request between the batch's empty and short requests (prefix < one tile);
//   draft_shift  the first s draft tokens made prefix (T - s draft tokens, prefix + s): the draft
//                block starts s tokens later, in another tile or split, and the rows that see all
//                of the first s tokens must not change.
// page_size and page_order keep the plan (B, T, H, kv_lens), so their outputs must be the same
// bit for bit. The others change the order of accumulation only, and are held to a tolerance
// derived from it (docs/detection.md, "Invariance probes"): per row, rel-L2 <= 2^-7 (bf16
// probabilities rounded against another running max, and the bf16 output's last bit) and
// |lse difference| <= 1e-4 (fp32 sums; lse sees no bf16 rounding), both far under what a wrong
// key set, a wrong mask bit or a row of another request gives.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/bundle/random_bundle.h"
#include "src/engine/engine.h"

namespace verifyd {

struct InvarianceTolerance {
  double max_row_rel_l2 = 1.0 / 128;  // 2^-7
  double max_lse_abs = 1e-4;          // natural log
};

// How two outputs of the same attention agree, over the rows compared.
struct RowAgreement {
  int64_t rows = 0;            // (token, head) rows compared
  int64_t differing_rows = 0;  // rows not equal bit for bit (o or lse)
  double max_row_rel_l2 = 0;   // ||test_row - base_row|| / ||base_row|| (inf: base row zero,
                               // test not)
  double max_lse_abs = 0;      // -inf on both sides is equal
  int64_t worst_row = -1;      // test's row of the largest rel-L2
  int64_t nonfinite = 0;       // NaN or Inf in test's o, NaN or +Inf in its lse
  bool exact() const { return differing_rows == 0; }
  void Add(const RowAgreement& o);
};

// Rows of `test` (bf16 o and lse, [rows, H]) against rows of `base`: token row k of test (one per
// (request, draft token)) against token row base_row(k) of base, each with its H heads; rows
// where base_row returns -1 are skipped.
RowAgreement CompareTokenRows(const PathOutput& test, const PathOutput& base, int heads,
                              int64_t token_rows, const std::function<int64_t(int64_t)>& base_row);

// Where the custom path runs: `load` makes a bundle current (the view outlives the runs on it),
// `run` runs the custom path on it with `splits` KV splits (0: the path's own plan) and brings its
// output (o and lse) to the host.
struct CustomRunner {
  std::function<absl::Status(const BundleView&)> load;
  std::function<absl::Status(int splits, PathOutput* out)> run;
  int tile_tokens = 64;  // the custom path's KV tile, to enumerate its split plans
};

// The engine's custom path as a runner (Prepare, RunCustomSplits, Fetch).
CustomRunner EngineCustomRunner(Engine& engine);

enum class InvarianceSweep {
  kFast,  // a subset for the periodic probe: a few split counts of each parity, one page size,
          // one permutation, the batch as given, one shift
  kFull,  // every check on every case: the start-up probe and verifyctl probe
};

// The forced split counts of a bundle of `max_tiles` tiles: full, the smallest count of each
// distinct tiles-per-split (1 .. max_tiles); fast, 2, 3, the first giving an even and an odd
// tiles-per-split above 1, and max_tiles. Both start with 0 (the plan's own) and 1.
std::vector<int> InvarianceSplitCounts(int64_t max_tiles, InvarianceSweep sweep);

struct InvarianceCase {
  std::string name;  // e.g. "ragged"
  RandomBundleSpec spec;
};

// Ragged batches whose prefixes are not multiples of the tile and put draft blocks across tile
// boundaries, with an empty and a short request among them; sized by `max_prefix` (the probe
// suite's: the CPU engine's cases stay small). `tile_tokens` places the straddling prefixes.
std::vector<InvarianceCase> InvarianceCases(int64_t max_prefix, int tile_tokens);

struct InvarianceResult {
  std::string name;  // "invariance/ragged/split_plan"
  bool passed = false;
  std::string reason;  // why it failed: the worst comparison, or the error
  int runs = 0;        // custom-path runs
  RowAgreement agreement;
  double seconds = 0;
};

// Every check of `sweep` on one case's bundle.
std::vector<InvarianceResult> RunInvarianceChecks(const CustomRunner& runner,
                                                  const InvarianceCase& c, InvarianceSweep sweep,
                                                  const InvarianceTolerance& tol = {});

}  // namespace verifyd
