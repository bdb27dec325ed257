// verifyd-engine-bench: what one call costs inside the engine, without a transport, and what the
// deferred comparison of shadow mode does to the next call. The inputs sit in device memory and
// are read in place (as a CUDA IPC region's are); the output goes to device memory (as o_out
// does). Calls come back to back, like `verifyctl send --resident`. Per mode and shape it
// reports the medians of the host's time in each engine step and of the served path's own GPU
// time, in one run:
//   reference      Prepare, Run(reference), Deliver, release
//   shadow         the same with the inputs snapshotted (Prepare with detach) and, after each
//                  call, Run(custom) + Compare queued to a ShadowRunner thread, as the daemon does
//   shadow-serial  shadow, but each call waits for its comparison before the next one starts
// The difference between shadow and shadow-serial is what the deferred work costs the next call
// (GPU and host contention); between shadow-serial and reference, the snapshot.
//
//   verifyd-engine-bench [--engine cuda|cpu] [--calls N] [--commit C] [--out DIR]

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "src/bundle/random_bundle.h"
#include "src/engine/engine_factory.h"
#include "src/region/mapped_region.h"
#include "src/region/region_registry.h"
#include "src/server/shadow_runner.h"

namespace verifyd::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The output's destination: device memory on the CUDA engine (as a CUDA IPC o_out region is),
// host memory on the CPU engine.
class BenchRegion : public MappedRegion {
 public:
  BenchRegion(char* base, uint64_t bytes, int device)
      : base_(base), bytes_(bytes), device_(device) {}
  char* base() const override { return base_; }
  uint64_t byte_size() const override { return bytes_; }
  int device() const override { return device_; }
  absl::Status ReadToHost(uint64_t, uint64_t, void*) const override {
    return absl::UnimplementedError("not read back");
  }

 private:
  char* base_;
  uint64_t bytes_;
  int device_;
};

// Memory that holds the bundle's q and pool (and the output) where the engine reads in place.
class Buffer {
 public:
  Buffer(size_t bytes, bool device) : device_(device) {
    if (device_) {
      if (cudaMalloc(&p_, bytes) != cudaSuccess) p_ = nullptr;
      return;
    }
    host_.resize(bytes);
    p_ = host_.data();
  }
  ~Buffer() {
    if (device_ && p_ != nullptr) cudaFree(p_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* get() const { return static_cast<char*>(p_); }
  bool Fill(const void* src, size_t bytes) {
    if (device_) return cudaMemcpy(p_, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
    std::copy_n(static_cast<const char*>(src), bytes, get());
    return true;
  }

 private:
  bool device_;
  void* p_ = nullptr;
  std::vector<char> host_;
};

struct Shape {
  int batch, draft, heads;
  int64_t prefix;
};

struct Step {
  std::vector<double> prepare, served, deliver, release, total, device;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double P99(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * 99 / 100)];
}

struct Row {
  std::string mode;
  Shape shape;
  int calls = 0, errors = 0;
  std::string first_error;
  double prepare_ms = 0, served_ms = 0, deliver_ms = 0, release_ms = 0, p50_ms = 0, p99_ms = 0;
  double device_ms = 0;
};

Row RunMode(Engine& engine, const std::string& mode, const Shape& sh, int calls, bool on_device) {
  RandomBundleSpec spec;
  spec.batch = sh.batch;
  spec.draft = sh.draft;
  spec.heads = sh.heads;
  spec.prefix = sh.prefix;
  spec.page_size = 64;
  spec.seed = 11;
  RandomBundle bundle(spec);
  BundleView v = bundle.view();
  Buffer q(size_t(v.q_elems()) * 2, on_device), pool(size_t(v.kv_elems()) * 2, on_device);
  const uint64_t o_bytes = uint64_t(v.o_elems()) * 2;
  Buffer o(o_bytes, on_device);
  Row row;
  row.mode = mode;
  row.shape = sh;
  if (q.get() == nullptr || pool.get() == nullptr || o.get() == nullptr ||
      !q.Fill(v.q, size_t(v.q_elems()) * 2) || !pool.Fill(v.kv_pool, size_t(v.kv_elems()) * 2)) {
    row.errors = 1;
    row.first_error = "could not stage the inputs";
    return row;
  }
  v.q = reinterpret_cast<const uint16_t*>(q.get());
  v.kv_pool = reinterpret_cast<const uint16_t*>(pool.get());
  v.q_device = on_device ? 0 : -1;
  v.kv_pool_device = on_device ? 0 : -1;
  v.kv_pool_shared = true;
  BenchRegion region(o.get(), o_bytes, on_device ? 0 : -1);
  RegionRange out;
  out.region = &region;
  out.data = o.get();
  out.byte_size = o_bytes;

  const bool shadow = mode != "reference";
  const bool serial = mode == "shadow-serial";
  ShadowRunner runner(1, 64);
  Step st;
  const int warmup = std::max(3, calls / 10);
  for (int i = 0; i < warmup + calls; ++i) {
    const auto t0 = Clock::now();
    auto prepared = engine.PrepareOn(0, v, shadow);
    const double prepare_s = Since(t0);
    if (!prepared.ok()) {
      if (row.errors++ == 0) row.first_error = prepared.status().ToString();
      continue;
    }
    std::shared_ptr<PreparedBundle> b = *std::move(prepared);
    auto t1 = Clock::now();
    absl::Status s = engine.Run(Path::kReference, *b);
    const double served_s = Since(t1);
    t1 = Clock::now();
    if (s.ok()) s = engine.Deliver(Path::kReference, *b, out, nullptr);
    const double deliver_s = Since(t1);
    absl::StatusOr<double> device_s = engine.PathSeconds(Path::kReference, *b);
    if (!s.ok() || !device_s.ok()) {
      if (row.errors++ == 0) row.first_error = (s.ok() ? device_s.status() : s).ToString();
      continue;
    }
    double release_s = 0;
    if (shadow) {
      // What the handler does after the response: the other path and the comparison, off the
      // call's critical path; the bundle is released when the job drops it.
      runner.TrySubmit([&engine, b] {
        if (engine.Run(Path::kCustom, *b).ok()) {
          (void)engine.Compare(*b, Path::kCustom, Path::kReference, Tolerance{});
        }
      });
      b.reset();
      if (serial) runner.WaitIdle();
    } else {
      t1 = Clock::now();
      b.reset();
      release_s = Since(t1);
    }
    const double total_s = Since(t0);
    if (i < warmup) continue;
    st.prepare.push_back(prepare_s);
    st.served.push_back(served_s);
    st.deliver.push_back(deliver_s);
    st.release.push_back(release_s);
    st.total.push_back(serial ? prepare_s + served_s + deliver_s : total_s);
    st.device.push_back(*device_s);
  }
  runner.WaitIdle();
  row.calls = static_cast<int>(st.total.size());
  row.prepare_ms = Median(st.prepare) * 1e3;
  row.served_ms = Median(st.served) * 1e3;
  row.deliver_ms = Median(st.deliver) * 1e3;
  row.release_ms = Median(st.release) * 1e3;
  row.p50_ms = Median(st.total) * 1e3;
  row.p99_ms = P99(st.total) * 1e3;
  row.device_ms = Median(st.device) * 1e3;
  return row;
}

}  // namespace
}  // namespace verifyd::bench

int main(int argc, char** argv) {
  using namespace verifyd;
  using namespace verifyd::bench;
  std::string engine_kind = "cuda", out_dir, commit = "unknown";
  int calls = 300;
  CLI::App app{"verifyd-engine-bench: one call's engine steps, reference and shadow, no transport"};
  app.add_option("--engine", engine_kind, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--calls", calls, "calls per mode and shape")->check(CLI::Range(1, 1000000));
  app.add_option("--out", out_dir, "directory for engine-bench-<engine>.{md,json}");
  app.add_option("--commit", commit, "the commit the binary was built from, for the tables");
  CLI11_PARSE(app, argc, argv);

  EngineOptions eo;
  eo.kind = engine_kind;
  auto engine = MakeEngine(eo);
  if (!engine.ok()) {
    std::fprintf(stderr, "verifyd-engine-bench: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  const bool on_device = engine_kind == "cuda";
  const std::vector<Shape> shapes =
      on_device ? std::vector<Shape>{{1, 64, 16, 8192}, {4, 16, 8, 4096}}
                : std::vector<Shape>{{1, 4, 2, 512}};  // the CPU engine: a smoke run
  std::vector<Row> rows;
  for (const Shape& sh : shapes) {
    for (const char* mode : {"reference", "shadow", "shadow-serial"}) {
      rows.push_back(RunMode(**engine, mode, sh, calls, on_device));
    }
  }
  const std::string device = (*engine)->Info().device;
  std::string md = "# verifyd-engine-bench on " + device + "\n\ncommit `" + commit + "`, " +
                   std::to_string(calls) +
                   " calls per row after a warm-up; medians of each engine step's host time, "
                   "calls back to back, inputs read in place (in device memory on the CUDA "
                   "engine)\n\n";
  md +=
      "| mode | B,T,H,prefix | calls | p50 ms | p99 ms | prepare ms | served path ms | deliver ms "
      "| release ms | served path's GPU ms | errors |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
      "---:|---:|\n";
  nlohmann::json j = nlohmann::json::array();
  int errors = 0;
  for (const Row& r : rows) {
    char line[512];
    std::snprintf(line, sizeof line,
                  "| %s | %d,%d,%d,%lld | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f "
                  "| %d |\n",
                  r.mode.c_str(), r.shape.batch, r.shape.draft, r.shape.heads,
                  static_cast<long long>(r.shape.prefix), r.calls, r.p50_ms, r.p99_ms, r.prepare_ms,
                  r.served_ms, r.deliver_ms, r.release_ms, r.device_ms, r.errors);
    md += line;
    errors += r.errors;
    if (!r.first_error.empty()) {
      std::fprintf(stderr, "%s %d,%d,%d: %s\n", r.mode.c_str(), r.shape.batch, r.shape.draft,
                   r.shape.heads, r.first_error.c_str());
    }
    j.push_back({{"commit", commit},
                 {"device", device},
                 {"mode", r.mode},
                 {"B", r.shape.batch},
                 {"T", r.shape.draft},
                 {"H", r.shape.heads},
                 {"prefix", r.shape.prefix},
                 {"calls", r.calls},
                 {"p50_ms", r.p50_ms},
                 {"p99_ms", r.p99_ms},
                 {"prepare_ms", r.prepare_ms},
                 {"served_ms", r.served_ms},
                 {"deliver_ms", r.deliver_ms},
                 {"release_ms", r.release_ms},
                 {"device_ms", r.device_ms},
                 {"errors", r.errors}});
  }
  std::fputs(md.c_str(), stdout);
  if (!out_dir.empty()) {
    const std::string base = out_dir + "/engine-bench-" + engine_kind;
    std::ofstream(base + ".md") << md;
    std::ofstream(base + ".json") << j.dump(1) << "\n";
  }
  return errors == 0 ? 0 : 1;
}
