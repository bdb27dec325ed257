#include "src/cpu_engine/cpu_engine.h"

#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "src/bundle/dequantized_bundle.h"
#include "src/common/bf16.h"
#include "src/cpu_engine/cpu_oracle.h"
#include "src/cpu_engine/cpu_reference.h"

namespace verifyd {
namespace {

// The bundle (borrowed or owned) and the outputs of the paths that ran on it. An e4m3 pool is
// also held dequantised to bf16, which the reference and custom paths read; the oracle reads the
// e4m3 bytes.
class CpuPreparedBundle : public PreparedBundle {
 public:
  CpuPreparedBundle(const BundleView& v, bool detach)
      : PreparedBundle(v.shape),
        owned_(detach ? std::make_shared<const OwnedBundle>(v) : nullptr),
        view_(detach ? owned_->view() : v),
        bf16_(v.shape.kv_dtype == kernels::KvDtype::kE4m3
                  ? std::make_unique<const DequantizedBundle>(view_)
                  : nullptr) {}

  const BundleView& view() const { return view_; }
  // What the reference and custom paths read: the view, its pool in bf16.
  const BundleView& bf16_view() const { return bf16_ ? bf16_->view() : view_; }
  std::shared_ptr<const OwnedBundle> Inputs() const {
    return owned_ ? owned_ : std::make_shared<const OwnedBundle>(view_);
  }

  void Store(Path p, PathOutput out) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    outputs_[p] = std::make_shared<const PathOutput>(std::move(out));
  }
  // Shared so that a concurrent re-run of the same path cannot free what a reader holds.
  std::shared_ptr<const PathOutput> Get(Path p) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = outputs_.find(p);
    return it == outputs_.end() ? nullptr : it->second;
  }

 private:
  std::shared_ptr<const OwnedBundle> owned_;
  BundleView view_;
  std::unique_ptr<const DequantizedBundle> bf16_;
  mutable absl::Mutex mu_;
  std::map<Path, std::shared_ptr<const PathOutput>> outputs_ ABSL_GUARDED_BY(mu_);
};

// Whether the paths can read the bundle's bf16 tensors where they are (uint16_t loads; an e4m3
// pool is read by bytes).
bool Aligned(const BundleView& bundle) {
  return reinterpret_cast<uintptr_t>(bundle.q) % alignof(uint16_t) == 0 &&
         (bundle.shape.kv_dtype == kernels::KvDtype::kE4m3 ||
          reinterpret_cast<uintptr_t>(bundle.kv_pool) % alignof(uint16_t) == 0);
}

class CpuEngine : public Engine {
 public:
  CpuEngine(int threads, const CpuCustomConfig& custom)
      : threads_(threads > 0 ? threads
                             : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
        arena_(threads_),
        custom_(custom) {}

  EngineInfo Info() const override {
    EngineInfo info;
    info.engine = "cpu";
    info.device = absl::StrCat("cpu (", threads_, " threads)");
    info.custom_tile_tokens = custom_.tile_tokens;
    return info;
  }

  // A detached bundle, or one whose inline bytes start at an odd address, is a deep copy in host
  // memory (CpuPreparedBundle's OwnedBundle); an e4m3 pool's named pages are also held in bf16.
  int64_t PreparedHostBytes(const BundleView& bundle, bool detach) const override {
    return (detach || !Aligned(bundle) ? OwnedBundle::BytesFor(bundle) : 0) +
           (bundle.shape.kv_dtype == kernels::KvDtype::kE4m3 ? DequantizedBundle::BytesFor(bundle)
                                                             : 0);
  }

  absl::StatusOr<std::shared_ptr<PreparedBundle>> Prepare(const BundleView& bundle,
                                                          bool detach) override {
    if (std::string why = kernels::CheckShape(bundle.shape); !why.empty()) {
      return absl::InvalidArgumentError(why);
    }
    if (bundle.q == nullptr || bundle.kv_pool == nullptr || bundle.kv_indptr == nullptr ||
        (bundle.kv_indices == nullptr && bundle.shape.num_indices > 0) ||
        bundle.kv_lens == nullptr || bundle.tree_mask == nullptr) {
      return absl::InvalidArgumentError("bundle: a tensor is missing (null view)");
    }
    if (!bundle.on_host()) {
      return absl::FailedPreconditionError("q: the CPU engine reads host memory only");
    }
    // The paths read bf16 with uint16_t loads; inline bytes read in place may start at an odd
    // address, and are then copied first.
    return std::make_shared<CpuPreparedBundle>(bundle, detach || !Aligned(bundle));
  }

  absl::Status Run(Path path, PreparedBundle& pb) override { return RunPath(path, pb, nullptr); }

  absl::Status RunCustomSplits(PreparedBundle& pb, int splits) override {
    return RunPath(Path::kCustom, pb, nullptr, splits);
  }

  absl::Status RunForCall(Path path, PreparedBundle& pb, const CallContext& call) override {
    if (absl::Status st = call.Check(); !st.ok()) return st;
    return RunPath(path, pb, &call);
  }

  absl::Status RunPath(Path path, PreparedBundle& pb, const CallContext* call,
                       int force_splits = 0) {
    auto& b = static_cast<CpuPreparedBundle&>(pb);
    const BundleView& v = path == Path::kOracle ? b.view() : b.bf16_view();
    const auto start = std::chrono::steady_clock::now();
    PathOutput out;
    switch (path) {
      case Path::kOracle: {
        std::vector<double> o(v.o_elems()), lse(v.lse_elems());
        ForEachBlock(v, call, [&](int bi, int h0, int h1) {
          OracleRequestHeads(v, bi, h0, h1, o.data(), lse.data(), call);
        });
        out.o_f32.assign(o.begin(), o.end());
        out.lse.assign(lse.begin(), lse.end());
        break;
      }
      case Path::kReference:
        out.o.resize(v.o_elems());
        out.lse.resize(v.lse_elems());
        ForEachBlock(v, call, [&](int bi, int h0, int h1) {
          ReferenceRequestHeads(v, bi, h0, h1, out.o.data(), out.lse.data(), call);
        });
        break;
      case Path::kCustom: {
        const CustomFault fault = fault_snapshot();
        if (fault.kind == CustomFault::Kind::kError) {
          return absl::InternalError("injected custom-path fault");
        }
        CpuCustomConfig config = custom_;
        config.pv_bf16 = fault.kind == CustomFault::Kind::kBf16Pv;
        if (force_splits > 0) config.force_splits = force_splits;
        out.o.resize(v.o_elems());
        out.lse.resize(v.lse_elems());
        ForEachBlock(v, call, [&](int bi, int h0, int h1) {
          CustomRequestHeads(v, bi, h0, h1, config, out.o.data(), out.lse.data(), call);
        });
        ApplyFault(fault, &out);
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat("unknown path ", static_cast<int>(path)));
    }
    if (call != nullptr) {
      if (absl::Status st = call->Check(); !st.ok()) return st;  // the output is incomplete
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    b.Store(path, std::move(out));
    return absl::OkStatus();
  }

  absl::Status Fetch(Path path, PreparedBundle& pb, PathOutput* out) override {
    auto got = static_cast<CpuPreparedBundle&>(pb).Get(path);
    if (got == nullptr) return NotRun(path);
    *out = *got;
    return absl::OkStatus();
  }

  absl::StatusOr<double> PathSeconds(Path path, PreparedBundle& pb) override {
    auto got = static_cast<CpuPreparedBundle&>(pb).Get(path);
    if (got == nullptr) return NotRun(path);
    return got->seconds;
  }

  absl::StatusOr<bool> AllFinite(Path path, PreparedBundle& pb) override {
    if (path == Path::kOracle) return OracleNotChecked();
    auto got = static_cast<CpuPreparedBundle&>(pb).Get(path);
    if (got == nullptr) return NotRun(path);
    const bool o_finite = std::all_of(got->o.begin(), got->o.end(),
                                      [](uint16_t x) { return (x & 0x7f80) != 0x7f80; });
    const bool lse_finite = std::none_of(got->lse.begin(), got->lse.end(), [](float x) {
      return std::isnan(x) || x == std::numeric_limits<float>::infinity();
    });
    return o_finite && lse_finite;
  }

  absl::StatusOr<DiffStats> Compare(PreparedBundle& pb, Path test, Path ref,
                                    const Tolerance& tol) override {
    auto& b = static_cast<CpuPreparedBundle&>(pb);
    if (test == Path::kOracle) {
      return absl::InvalidArgumentError("compare: the oracle can only be the reference side");
    }
    auto t = b.Get(test);
    if (t == nullptr) return NotRun(test);
    auto r = b.Get(ref);
    if (r == nullptr) return NotRun(ref);
    const BundleView& v = b.view();
    const float* t_lse = t->lse.empty() ? nullptr : t->lse.data();
    const float* r_lse = r->lse.empty() ? nullptr : r->lse.data();
    const int64_t n_lse = (t_lse && r_lse) ? v.lse_elems() : 0;
    if (ref == Path::kOracle) {
      return CompareBf16ToF32(t->o.data(), r->o_f32.data(), v.o_elems(), t_lse, r_lse, n_lse, tol);
    }
    return CompareBf16(t->o.data(), r->o.data(), v.o_elems(), t_lse, r_lse, n_lse, tol);
  }

  absl::StatusOr<std::shared_ptr<const OwnedBundle>> FetchInputs(PreparedBundle& pb) override {
    return static_cast<CpuPreparedBundle&>(pb).Inputs();
  }

  void InjectCustomFault(const CustomFault& fault) override {
    absl::MutexLock lock(&fault_mu_);
    fault_ = fault;
  }

 private:
  static absl::Status OracleNotChecked() {
    return absl::InvalidArgumentError("finite check: only reference and custom outputs are served");
  }

  static absl::Status NotRun(Path p) {
    return absl::FailedPreconditionError(
        absl::StrCat("path ", PathName(p), " has not run on this bundle"));
  }

  CustomFault fault_snapshot() const {
    absl::MutexLock lock(&fault_mu_);
    return fault_;
  }

  static void ApplyFault(const CustomFault& fault, PathOutput* out) {
    if (fault.kind == CustomFault::Kind::kPerturb) {
      for (auto& x : out->o) {
        x = FloatToBf16(static_cast<float>(Bf16ToFloat(x) + fault.amount));
      }
    } else if (fault.kind == CustomFault::Kind::kNan && !out->o.empty()) {
      out->o[0] = 0x7fc0;
    }
  }

  // Calls fn(request, h0, h1) for blocks of heads so that there are about two blocks per
  // worker, on this engine's arena (shared by concurrent calls; no threads made per call).
  // Blocks not yet started are skipped once `call` (when given) is abandoned.
  template <typename Fn>
  void ForEachBlock(const BundleView& v, const CallContext* call, Fn&& fn) {
    const int B = v.shape.batch, H = v.shape.heads;
    const int blocks_per_request = std::clamp((2 * threads_ + B - 1) / B, 1, H);
    const int head_block = (H + blocks_per_request - 1) / blocks_per_request;
    const int per_request = (H + head_block - 1) / head_block;
    arena_.execute([&] {
      tbb::parallel_for(0, B * per_request, [&](int item) {
        if (call != nullptr && call->Abandoned()) return;
        const int b = item / per_request;
        const int h0 = (item % per_request) * head_block;
        fn(b, h0, std::min(H, h0 + head_block));
      });
    });
  }

  const int threads_;
  tbb::task_arena arena_;
  const CpuCustomConfig custom_;
  mutable absl::Mutex fault_mu_;
  CustomFault fault_ ABSL_GUARDED_BY(fault_mu_);
};

}  // namespace

std::unique_ptr<Engine> MakeCpuEngine(int threads, const CpuCustomConfig& custom) {
  return std::make_unique<CpuEngine>(threads, custom);
}

}  // namespace verifyd
