// verifyd-bench: times the custom kernel (both tile configurations) and, when built, the GPU
// reference path on the verify and decode shapes, against the GEMM and copy ceilings measured
// in the same run. Median of per-launch CUDA-event times, rotating input sets that together
// exceed the L2 cache several times. Writes <date>-<commit>-<device>.{md,json} to --out.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/bench_report.h"
#include "bench/bench_timing.h"
#include "bench/ceilings.h"
#include "kernels/custom/custom_attention.h"
#include "kernels/custom/custom_launch_plan.h"
#include "kernels/custom/custom_schedule.h"
#include "kernels/custom/variants/custom_variants.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/validate.h"
#include "src/common/build_version.h"
#include "src/compare/compare.h"
#include "src/io/bundle_file.h"
#if VERIFYD_BENCH_HAVE_REFERENCE
#include "kernels/reference/kv_dequantize_kernels.h"
#include "kernels/reference/reference_attention.h"
#endif

namespace verifyd::bench {
namespace {

struct Shape {
  int batch, draft, heads;
  int64_t prefix;
};

// (B, T, H, prefix): the verify shapes, then plain decode (T = 1).
constexpr Shape kShapes[] = {{1, 16, 8, 4096},   {8, 16, 8, 4096},  {32, 16, 8, 8192},
                             {4, 16, 64, 8192},  {4, 128, 8, 4096}, {1, 1024, 8, 2048},
                             {16, 8, 16, 32768}, {64, 4, 16, 2048}, {64, 1, 128, 4096},
                             {128, 1, 16, 8192}};

template <typename T>
struct DevPtr {
  T* p = nullptr;
  size_t bytes = 0;
  ~DevPtr() {
    if (p != nullptr) cudaFree(p);
  }
  cudaError_t Alloc(size_t n) {
    bytes = std::max<size_t>(n * sizeof(T), 16);
    return cudaMalloc(&p, bytes);
  }
};

// One copy of a bundle's inputs and outputs on the device. An e4m3 pool is kept as sent (kv8,
// named by indices) and a launch of a path that does not read the codes itself first turns its
// named pages into the compact bf16 pool `kv` (named by dq_ids), as the CUDA engine does;
// `problem` names that pool. `codes_problem` names the e4m3 pool as sent, for the paths that read
// the codes (v3e: custom-v3e, and custom where it resolves to v3e).
struct InputSet {
  DevPtr<uint16_t> q, kv, o;
  DevPtr<int32_t> indptr, indices, lens, dq_ids;
  DevPtr<uint8_t> mask, kv8;
  DevPtr<float> lse;
  kernels::VerifyProblem problem, codes_problem;
  bool e4m3 = false;
  int64_t src_pages = 0;
};

cudaError_t Upload(const BundleView& v, InputSet* s) {
  auto up = [](auto& d, const auto* src, size_t n) {
    cudaError_t e = d.Alloc(n);
    if (e == cudaSuccess && n > 0) {
      e = cudaMemcpy(d.p, src, n * sizeof(*src), cudaMemcpyHostToDevice);
    }
    return e;
  };
  cudaError_t e;
  if ((e = up(s->q, v.q, v.q_elems())) != cudaSuccess) return e;
  s->e4m3 = v.shape.kv_dtype == kernels::KvDtype::kE4m3;
  const int64_t n_named = v.shape.num_indices;
  const int64_t page_elems = int64_t{v.shape.page_size} * kernels::kHeadDimQK;
  if (s->e4m3) {
    if ((e = up(s->kv8, static_cast<const uint8_t*>(v.kv_pool), v.kv_elems())) != cudaSuccess ||
        (e = s->kv.Alloc(size_t(n_named * page_elems))) != cudaSuccess ||
        (e = s->dq_ids.Alloc(size_t(n_named))) != cudaSuccess) {
      return e;
    }
  } else if ((e = up(s->kv, static_cast<const uint16_t*>(v.kv_pool), v.kv_elems())) !=
             cudaSuccess) {
    return e;
  }
  if ((e = up(s->indptr, v.kv_indptr, v.shape.batch + 1)) != cudaSuccess) return e;
  if ((e = up(s->indices, v.kv_indices, v.shape.num_indices)) != cudaSuccess) return e;
  if ((e = up(s->lens, v.kv_lens, v.shape.batch)) != cudaSuccess) return e;
  if ((e = up(s->mask, v.tree_mask, v.mask_bytes())) != cudaSuccess) return e;
  if ((e = s->o.Alloc(v.o_elems())) != cudaSuccess) return e;
  if ((e = s->lse.Alloc(v.lse_elems())) != cudaSuccess) return e;
  kernels::VerifyProblem& p = s->problem;
  p.shape = v.shape;
  p.q = s->q.p;
  p.kv_pool = s->kv.p;
  p.kv_indptr = s->indptr.p;
  p.kv_indices = s->e4m3 ? s->dq_ids.p : s->indices.p;
  p.kv_lens = s->lens.p;
  p.tree_mask = s->mask.p;
  p.sm_scale = s->e4m3 ? v.sm_scale * v.kv_scale : v.sm_scale;
  if (s->e4m3) {  // the paths read the compact bf16 pool of the named pages
    s->codes_problem = p;
    s->codes_problem.kv_pool = reinterpret_cast<const uint16_t*>(s->kv8.p);
    s->codes_problem.kv_indices = s->indices.p;
    s->codes_problem.sm_scale = v.sm_scale;
    s->codes_problem.kv_scale = v.kv_scale;
    s->src_pages = v.shape.num_pages;
    p.shape.num_pages = n_named;
    p.shape.kv_dtype = kernels::KvDtype::kBf16;
    p.o_scale = v.kv_scale;  // onto o before its rounding, as the CUDA engine puts it
  }
  p.max_kv_len = v.max_kv_len;
  p.total_kv_len = v.total_kv_len;
  p.o = s->o.p;
  p.lse = s->lse.p;
  if (s->e4m3) {
    s->codes_problem.max_kv_len = p.max_kv_len;
    s->codes_problem.total_kv_len = p.total_kv_len;
    s->codes_problem.o = p.o;
    s->codes_problem.lse = p.lse;
  }
  return cudaSuccess;
}

std::string Today() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

// "NVIDIA H200" -> "h200"
std::string DeviceSlug(const std::string& name) {
  std::string s = name;
  if (s.rfind("NVIDIA ", 0) == 0) s = s.substr(7);
  std::string out;
  for (char c : s) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "gpu" : out;
}

struct Options {
  std::string out_dir = ".";
  std::string commit = VERIFYD_GIT_COMMIT;
  std::vector<int> pages = {1, 64};
  std::vector<std::string> kv_dtypes = {"bf16"};  // and/or "e4m3" (random shapes only)
  float kv_scale = 0.37f;                         // the e4m3 rows' pool scale
  std::vector<std::string> paths = {"custom",         "custom-v3",  "custom-v4",       "custom-v4k",
                                    "custom-v4c",     "custom-v5",  "custom-v5s",      "custom-v5t",
                                    "custom-qkwgmma", "custom-mma", "custom-sm120cfg", "reference"};
  double seconds_per_row = 0.25;
  int max_shapes = 0;
  int shape_index = -1;              // >= 0: only kShapes[shape_index] (for profiling one launch)
  std::vector<std::string> bundles;  // --bundle files; empty: the random shapes above
};

// The custom kernel's schedule a --paths name asks for: "custom" and "custom-sm120cfg" (the
// shipped choice, the latter with VERIFYD_FORCE_SM120_CONFIG's tiles), "custom-" + its name
// (custom_schedule.h) otherwise. False for a name that is none of these.
bool ScheduleOf(const std::string& path, kernels::CustomSchedule* schedule) {
  *schedule = kernels::CustomSchedule::kAuto;
  if (path == "custom" || path == "custom-sm120cfg") return true;
  for (int i = 0; i <= static_cast<int>(kernels::CustomSchedule::kMmaSync); ++i) {
    const auto s = static_cast<kernels::CustomSchedule>(i);
    if (s != kernels::CustomSchedule::kAuto &&
        path == std::string("custom-") + kernels::ScheduleName(s)) {
      *schedule = s;
      return true;
    }
  }
  return false;
}

// One bundle on the device, with what every path's row on it is measured against.
struct BundleRun {
  BundleRun(const BundleView& view, const Shape& shape, int page_size)
      : v(view), sh(shape), page(page_size) {}
  const BundleView& v;
  Shape sh;
  int page;
  double flops = 0, bytes = 0;          // the work and the traffic of one launch
  double t_flop_ms = 0, t_byte_ms = 0;  // their times at the measured ceilings
  int sets = 0;
  std::vector<std::unique_ptr<InputSet>> in;  // rotated through so that no launch hits the L2
  std::vector<uint16_t> ref_o;                // the reference's output of set 0, once it ran
};

class Bench {
 public:
  explicit Bench(const Options& opt) : opt_(opt) {}
  int Run();

 private:
  using Launch = std::function<cudaError_t(int)>;

  bool Start();
  bool BenchBundleFiles();
  void BenchRandomShapes();
  void BenchOne(const BundleView& v, const Shape& sh, int page);
  BenchRow RunPath(const std::string& path, BundleRun& b);
  Launch PathLaunch(const std::string& path, const BundleRun& b, DevPtr<uint8_t>* ws, BenchRow* row,
                    bool* reads_codes);
  Launch WithDequantization(Launch path, const BundleRun& b, BenchRow* row);
  void TimeRow(const Launch& launch, const std::string& path, BundleRun& b, BenchRow* row);
  // Writes `report` as <out>/<date>-<commit>-<device>.{md,json}; `say` prints the table and the
  // files' names. False when a file could not be written.
  bool WriteReport(const BenchReport& report, bool say);

  const Options& opt_;
  const bool want_ref_ =
      std::find(opt_.paths.begin(), opt_.paths.end(), "reference") != opt_.paths.end();
  cudaDeviceProp prop_{};
  BenchReport report_;
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<BenchRow> ref_rows_;  // appended after every custom row
};

int Bench::Run() {
  if (!Start()) return 2;
  if (!opt_.bundles.empty()) {
    if (!BenchBundleFiles()) return 2;
  } else {
    BenchRandomShapes();
  }
  report_.rows.insert(report_.rows.end(), ref_rows_.begin(), ref_rows_.end());
  cublasDestroy(handle_);
  return WriteReport(report_, true) ? 0 : 1;
}

// The device, cuBLAS and the ceilings every row is judged against; false without a device or
// cuBLAS.
bool Bench::Start() {
  if (cudaGetDeviceProperties(&prop_, 0) != cudaSuccess) {
    std::fprintf(stderr, "verifyd-bench: no CUDA device\n");
    return false;
  }
  cudaSetDevice(0);
  report_.device = prop_.name;
  report_.commit = opt_.commit;
  report_.date = Today();
  report_.sms = prop_.multiProcessorCount;
  if (cublasCreate(&handle_) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "verifyd-bench: cublasCreate failed\n");
    return false;
  }
  report_.ceilings = MeasureCeilings(handle_);
  std::printf("ceilings: GEMM %.1f TFLOP/s, copy %.0f GB/s %s\n", report_.ceilings.gemm_tflops,
              report_.ceilings.copy_gbps, report_.ceilings.error.c_str());
  cudaStreamCreate(&stream_);
  return true;
}

// The --bundle files; false when one does not load or is not a valid bundle.
bool Bench::BenchBundleFiles() {
  for (const std::string& file : opt_.bundles) {
    absl::StatusOr<BundleFile> f = LoadBundleFile(file);
    absl::Status st = f.ok() ? ValidateBundle(f->view) : f.status();
    if (!st.ok()) {
      std::fprintf(stderr, "verifyd-bench: %s: %s\n", file.c_str(),
                   std::string(st.message()).c_str());
      return false;
    }
    const BundleView& v = f->view;
    BenchOne(v, {v.shape.batch, v.shape.draft, v.shape.heads, v.max_kv_len - v.shape.draft},
             v.shape.page_size);
  }
  return true;
}

// The built-in shapes at every --pages size, as random bundles.
void Bench::BenchRandomShapes() {
  int shapes_done = 0;
  for (int page : opt_.pages) {
    for (const Shape& sh : kShapes) {
      if (opt_.max_shapes > 0 && shapes_done >= opt_.max_shapes) break;
      ++shapes_done;
      if (opt_.shape_index >= 0 && &sh != &kShapes[opt_.shape_index]) continue;
      for (const std::string& kv : opt_.kv_dtypes) {
        RandomBundleSpec spec;
        spec.batch = sh.batch;
        spec.draft = sh.draft;
        spec.heads = sh.heads;
        spec.page_size = page;
        spec.prefix = sh.prefix;
        spec.tree = TreeKind::kRandomTree;
        spec.seed = 1000 + shapes_done;  // the same values in both dtypes
        if (kv == "e4m3") {
          spec.kv_dtype = kernels::KvDtype::kE4m3;
          spec.kv_scale = opt_.kv_scale;
        }
        const RandomBundle bundle(spec);
        BenchOne(bundle.view(), sh, page);
      }
    }
  }
}

// Times every requested path on one bundle (random, or from a --bundle file).
void Bench::BenchOne(const BundleView& v, const Shape& sh, int page) {
  BundleRun b(v, sh, page);
  b.flops = 2.0 * sh.draft * sh.heads * double(v.total_kv_len) *
            (kernels::kHeadDimQK + kernels::kHeadDimV);
  b.bytes = double(v.total_kv_len) * kernels::kHeadDimQK * v.kv_elem_bytes() +
            double(v.q_elems()) * 2 + double(v.o_elems()) * 2;
  b.t_flop_ms = b.flops / (report_.ceilings.gemm_tflops * 1e12) * 1e3;
  b.t_byte_ms = b.bytes / (report_.ceilings.copy_gbps * 1e9) * 1e3;

  // Enough distinct copies that one pass over them is >= 4x the L2 cache.
  const double set_bytes =
      double(v.kv_elems()) * v.kv_elem_bytes() + double(v.q_elems()) * 2 + double(v.o_elems()) * 2;
  b.sets = std::clamp(static_cast<int>(std::ceil(4.0 * prop_.l2CacheSize / set_bytes)), 2, 16);
  bool ok = true;
  for (int k = 0; k < b.sets && ok; ++k) {
    b.in.push_back(std::make_unique<InputSet>());
    ok = Upload(v, b.in.back().get()) == cudaSuccess;
  }
  if (!ok) {
    std::fprintf(stderr, "upload failed for B=%d T=%d H=%d\n", sh.batch, sh.draft, sh.heads);
    return;
  }
  // The reference runs first so that the custom rows can report their difference to it.
  BenchRow ref_row;
  if (want_ref_) ref_row = RunPath("reference", b);
  for (const std::string& path : opt_.paths) {
    if (path != "reference") report_.rows.push_back(RunPath(path, b));
  }
  if (want_ref_) ref_rows_.push_back(ref_row);
  // The rows so far, written after each bundle: a run cut short (a device call's time limit)
  // keeps its files; the last write, at the end, has every row.
  BenchReport so_far = report_;
  so_far.rows.insert(so_far.rows.end(), ref_rows_.begin(), ref_rows_.end());
  WriteReport(so_far, false);
}

BenchRow Bench::RunPath(const std::string& path, BundleRun& b) {
  BenchRow row;
  row.path = path;
  row.batch = b.sh.batch;
  row.draft = b.sh.draft;
  row.heads = b.sh.heads;
  row.prefix = b.sh.prefix;
  row.page_size = b.page;
  row.kv_dtype = kernels::KvDtypeName(b.v.shape.kv_dtype);
  row.floor_ms = std::max(b.t_flop_ms, b.t_byte_ms);
  row.compute_bound = b.t_flop_ms >= b.t_byte_ms;
  DevPtr<uint8_t> ws;
  bool reads_codes = false;
  Launch launch = PathLaunch(path, b, &ws, &row, &reads_codes);
  if (row.error.empty() && b.in[0]->e4m3 && !reads_codes) {
    launch = WithDequantization(std::move(launch), b, &row);
  }
  if (row.error.empty()) TimeRow(launch, path, b, &row);
  std::printf(
      "%-16s %-4s B=%-3d T=%-4d H=%-3d prefix=%-6lld page=%-3d %9.4f ms %7.1f TFLOP/s "
      "%6.0f GB/s floor %.4f ms ratio %.2f splits %d %s\n",
      path.c_str(), row.kv_dtype.c_str(), b.sh.batch, b.sh.draft, b.sh.heads,
      static_cast<long long>(b.sh.prefix), b.page, row.ms, row.tflops, row.gbps, row.floor_ms,
      row.ms > 0 ? row.ms / row.floor_ms : 0.0, row.splits, row.error.c_str());
  std::fflush(stdout);
  return row;
}

// One launch of the path on input set i, its workspace in `ws`; sets row->error when the path
// cannot run, row->splits for a custom path, and *reads_codes when it reads an e4m3 pool's codes
// itself (else an e4m3 row's launch dequantises the named pages first).
Bench::Launch Bench::PathLaunch(const std::string& path, const BundleRun& b, DevPtr<uint8_t>* ws,
                                BenchRow* row, bool* reads_codes) {
  if (path.rfind("custom", 0) == 0) {
    kernels::CustomConfig cfg;
    cfg.small_smem = path == "custom-sm120cfg";
    kernels::CustomSchedule schedule;
    if (!ScheduleOf(path, &schedule)) {
      row->error = "no such custom schedule";
      return nullptr;
    }
    // custom-v3e reads an e4m3 pool's codes (no dequantisation first); it runs on e4m3 rows only.
    // The shipped choice reads them where it resolves to v3e, as the CUDA engine's custom path
    // does (CudaPreparedBundle::custom_problem); custom-v5t names the dequantised pages' kernel.
    if (kernels::ScheduleReadsE4m3(schedule) && !b.in[0]->e4m3) {
      row->error = "custom-v3e reads e4m3 pools only";
      return nullptr;
    }
    kernels::CustomPlan probe;
    const bool codes =
        kernels::ScheduleReadsE4m3(schedule) ||
        (b.in[0]->e4m3 && schedule == kernels::CustomSchedule::kAuto &&
         kernels::ResolveCustomPlan(b.in[0]->codes_problem, cfg, &probe) == cudaSuccess);
    *reads_codes = codes;
    const auto problem_of = [codes](const InputSet& s) -> const kernels::VerifyProblem& {
      return codes ? s.codes_problem : s.problem;
    };
    kernels::CustomPlan plan;
    size_t wsb = 0;  // where the schedule does not run, the launch says why
    if (kernels::ResolveCustomPlan(problem_of(*b.in[0]), cfg, &plan, schedule) == cudaSuccess) {
      row->splits = plan.splits;
      wsb = plan.workspace_bytes;
    }
    if (ws->Alloc(wsb) != cudaSuccess) row->error = "workspace";
    return [this, &b, ws, cfg, wsb, schedule, problem_of](int i) {
      return kernels::LaunchCustomVariant(problem_of(*b.in[i % b.sets]), cfg, schedule, ws->p, wsb,
                                          stream_);
    };
  }
#if VERIFYD_BENCH_HAVE_REFERENCE
  const size_t wsb = kernels::ReferenceWorkspaceBytes(b.in[0]->problem);
  if (ws->Alloc(wsb) != cudaSuccess) row->error = "workspace";
  return [this, &b, ws, wsb](int i) {
    return kernels::LaunchReference(b.in[i % b.sets]->problem, ws->p, wsb, handle_, stream_);
  };
#else
  row->error = "reference path not built";
  return nullptr;
#endif
}

// An e4m3 bundle's launch as the CUDA engine makes it: the named pages to bf16, then the path on
// them (kv_scale on sm_scale, and on o before its rounding: VerifyProblem::o_scale).
Bench::Launch Bench::WithDequantization(Launch path, const BundleRun& b, BenchRow* row) {
#if VERIFYD_BENCH_HAVE_REFERENCE
  (void)row;
  return [this, &b, path = std::move(path)](int i) {
    const InputSet& s = *b.in[i % b.sets];
    const int64_t page_elems = int64_t{s.problem.shape.page_size} * kernels::kHeadDimQK;
    cudaError_t e =
        kernels::LaunchDequantizeE4m3Pages(s.kv8.p, s.indices.p, s.problem.shape.num_indices,
                                           s.src_pages, page_elems, s.kv.p, s.dq_ids.p, stream_);
    return e == cudaSuccess ? path(i) : e;
  };
#else
  (void)path;
  (void)b;
  row->error = "e4m3 rows need the reference kernels (their dequantisation)";
  return nullptr;
#endif
}

// The median launch time and the rates it makes, and set 0's output against the reference's.
void Bench::TimeRow(const Launch& launch, const std::string& path, BundleRun& b, BenchRow* row) {
  // One timed launch sizes the repetition count.
  const double probe = MedianMs(stream_, 1, 1, launch);
  const int reps =
      probe > 0 ? std::clamp(static_cast<int>(opt_.seconds_per_row * 1e3 / probe), 10, 200) : 1;
  row->ms = probe > 0 ? MedianMs(stream_, 2, reps, launch) : -1;
  if (row->ms <= 0) {
    row->error = cudaGetErrorString(cudaGetLastError());
    return;
  }
  row->tflops = b.flops / (row->ms * 1e-3) / 1e12;
  row->gbps = b.bytes / (row->ms * 1e-3) / 1e9;
  // Output of set 0 from its last launch, against the reference's.
  std::vector<uint16_t> o(b.v.o_elems());
  cudaMemcpy(o.data(), b.in[0]->o.p, o.size() * 2, cudaMemcpyDeviceToHost);
  if (path == "reference") {
    b.ref_o = std::move(o);
  } else if (!b.ref_o.empty()) {
    const DiffStats d =
        CompareBf16(o.data(), b.ref_o.data(), int64_t(o.size()), nullptr, nullptr, 0, Tolerance{});
    row->rel_l2_vs_reference = d.rel_l2;
  }
}

bool Bench::WriteReport(const BenchReport& report, bool say) {
  std::error_code ec;
  std::filesystem::create_directories(opt_.out_dir, ec);
  const std::string base =
      opt_.out_dir + "/" + report.date + "-" + report.commit + "-" + DeviceSlug(report.device);
  std::ofstream md(base + ".md"), js(base + ".json");
  md << ToMarkdown(report);
  js << ToJson(report);
  md.close();
  js.close();
  if (say) std::printf("\n%s\n", ToMarkdown(report).c_str());
  if (!md || !js) {
    std::fprintf(stderr, "verifyd-bench: could not write %s.{md,json}\n", base.c_str());
    return false;
  }
  if (say) std::printf("wrote %s.{md,json}\n", base.c_str());
  return true;
}

}  // namespace
}  // namespace verifyd::bench

int main(int argc, char** argv) {
  verifyd::bench::Options opt;
  CLI::App app{"verifyd-bench: the custom kernel and the reference path vs the H200 roofline"};
  app.add_option("--out", opt.out_dir, "directory for <date>-<commit>-<device>.{md,json}");
  app.add_option("--commit", opt.commit, "commit the binaries were built from");
  app.add_option("--pages", opt.pages, "page sizes to run");
  app.add_option("--kv-dtypes", opt.kv_dtypes,
                 "KV pool dtypes of the random shapes: bf16 and/or e4m3 (read as the CUDA engine "
                 "reads them: the codes by v3e, the dequantised pages by the other paths)")
      ->check(CLI::IsMember({"bf16", "e4m3"}));
  app.add_option("--kv-scale", opt.kv_scale, "the e4m3 rows' pool scale")
      ->check(CLI::PositiveNumber);
  app.add_option(
      "--paths", opt.paths,
      "custom (the shipped choice), custom-sm120cfg (with VERIFYD_FORCE_SM120_CONFIG), the "
      "shipped schedules custom-v5t, custom-sm120 and custom-v3e (e4m3 rows only), the "
      "bench-only custom-v5, custom-v5s, custom-v4, custom-v4k, custom-v4c, custom-v3, "
      "custom-qkwgmma, custom-mma; reference");
  app.add_option("--seconds-per-row", opt.seconds_per_row, "timing budget per row");
  app.add_option("--max-shapes", opt.max_shapes, "stop after this many (shape, page) pairs");
  app.add_option("--shape-index", opt.shape_index, "run only this shape of the built-in list")
      ->check(CLI::Range(0, static_cast<int>(std::size(verifyd::bench::kShapes)) - 1));
  app.add_option("--bundle", opt.bundles,
                 "time the paths on these .safetensors bundles (captures, golden cases) instead");
  CLI11_PARSE(app, argc, argv);
  return verifyd::bench::Bench(opt).Run();
}
