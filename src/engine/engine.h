#pragma once
// The engine interface: where a bundle's paths run (CPU or one CUDA device per worker).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"
#include "src/compare/compare.h"
#include "src/engine/call_context.h"
#include "src/region/region_registry.h"

namespace verifyd {

enum class Path { kReference = 0, kCustom = 1, kOracle = 2 };

inline const char* PathName(Path p) {
  switch (p) {
    case Path::kReference:
      return "reference";
    case Path::kCustom:
      return "custom";
    case Path::kOracle:
      return "oracle";
  }
  return "unknown";
}

// Test-only fault injection into the custom path (flag --inject_custom_fault). Engines apply it
// inside Run(kCustom) so that every layer above sees a real failing or wrong path.
struct CustomFault {
  // kBf16Pv: the P·V accumulator rounded to bf16 after every key, a precision loss that stays
  // within the per-call tolerances (CPU engine only).
  enum class Kind { kNone, kError, kPerturb, kNan, kBf16Pv } kind = Kind::kNone;
  double amount = 0;  // kPerturb: added to every output element (after bf16 rounding)
};

// Called once by an engine whose device context is lost (a sticky CUDA fault): every later call
// on that device fails, whichever caller (a call, the shadow runner, a probe) ran into it first.
using DeviceLostHandler = std::function<void(const absl::Status&)>;

// One path's output on the host. Reference and custom fill `o` (bf16); the oracle fills `o_f32`.
struct PathOutput {
  std::vector<uint16_t> o;   // bf16 [B*T, H, 512]
  std::vector<float> o_f32;  // fp32 [B*T, H, 512], oracle only
  std::vector<float> lse;    // fp32 [B*T, H]
  double seconds = 0;        // time the path itself took
};

// A bundle's inputs where the engine runs them, plus the outputs of the paths run on it.
// Engines subclass it; the server only passes it back to the engine that made it.
class PreparedBundle {
 public:
  virtual ~PreparedBundle() = default;
  const kernels::ProblemShape& shape() const { return shape_; }

 protected:
  explicit PreparedBundle(const kernels::ProblemShape& s) : shape_(s) {}

 private:
  kernels::ProblemShape shape_;
};

struct EngineInfo {
  std::string engine;  // "cpu" or "cuda"
  std::string device;  // "cpu (8 threads)" or "NVIDIA H200"
  int sm_count = 0;
  std::string compute_capability;  // "9.0"; empty on CPU
  int custom_tile_tokens = 64;     // KV tokens per tile of the custom path's plan
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual EngineInfo Info() const = 0;

  // Takes what the paths need from a validated bundle. With `detach`, the result no longer
  // refers to `bundle`'s memory (for work that outlives the request).
  virtual absl::StatusOr<std::shared_ptr<PreparedBundle>> Prepare(const BundleView& bundle,
                                                                  bool detach) = 0;
  // Prepare() on one device: requests name a device, 0 by default. INVALID_ARGUMENT naming the
  // field when the engine has no such device.
  virtual absl::StatusOr<std::shared_ptr<PreparedBundle>> PrepareOn(int device,
                                                                    const BundleView& bundle,
                                                                    bool detach) {
    if (device != 0) {
      return absl::InvalidArgumentError("device: " + std::to_string(device) +
                                        " is not served (this engine has device 0 only)");
    }
    return Prepare(bundle, detach);
  }
  // Runs one path; its output stays in `b` until fetched or compared.
  // Host memory Prepare(bundle, detach) copies the bundle's inputs into, beyond what the call
  // itself holds (0: none, or the engine keeps its copy elsewhere, e.g. in device memory).
  virtual int64_t PreparedHostBytes(const BundleView& bundle, bool detach) const {
    (void)bundle;
    (void)detach;
    return 0;
  }
  virtual absl::Status Run(Path path, PreparedBundle& b) = 0;
  // Run() for a call whose client may give up: CANCELLED or DEADLINE_EXCEEDED (nothing stored)
  // when `call` is abandoned. Engines check before starting the path; the CPU engine also
  // between tiles and KV chunks.
  virtual absl::Status RunForCall(Path path, PreparedBundle& b, const CallContext& call) {
    if (absl::Status st = call.Check(); !st.ok()) return st;
    return Run(path, b);
  }
  // Run(kCustom) with the custom path's KV split count fixed at `splits` (clamped to the tiles of
  // the bundle's longest request; 0: the engine's own plan): the invariance probes run one bundle
  // under several plans. An engine whose custom path has no KV split runs Run(kCustom).
  virtual absl::Status RunCustomSplits(PreparedBundle& b, int splits) {
    (void)splits;
    return Run(Path::kCustom, b);
  }
  // Copies a path's output to the host.
  virtual absl::Status Fetch(Path path, PreparedBundle& b, PathOutput* out) = 0;
  // The time a path's own work took where it ran (on a GPU: between the events around its
  // kernels), once its output was fetched, delivered or compared.
  virtual absl::StatusOr<double> PathSeconds(Path path, PreparedBundle& b) = 0;
  // Writes a path's output (reference or custom) into registered regions: o into `o`, lse into
  // `lse` when given. Complete when it returns. This default goes through Fetch() and reaches
  // host regions only.
  virtual absl::Status Deliver(Path path, PreparedBundle& b, const RegionRange& o,
                               const RegionRange* lse);
  // Fills a registered range with zeros (the output of a call that failed where the client reads
  // it without an answer: doorbell channels). Complete when it returns. This default reaches
  // host regions only.
  virtual absl::Status ZeroFill(const RegionRange& r);
  // Copies a registered range's r.byte_size bytes to host memory at `dst`, or from `src` into
  // the range (a shadow tap's slots: the stack's output out, verifyd's control words in).
  // Complete when they return. These defaults reach host regions only.
  virtual absl::Status ReadRange(const RegionRange& r, void* dst);
  virtual absl::Status WriteRange(const RegionRange& r, const void* src);
  // Makes host memory (a shm region) readable by the engine's devices without a staging copy;
  // returns what undoes it. Engines without devices do nothing.
  virtual absl::StatusOr<std::function<void()>> PinHostMemory(void* base, uint64_t bytes) {
    (void)base, (void)bytes;
    return std::function<void()>();
  }
  // Opens a CUDA IPC memory handle (64 bytes) on `device`, for a region of `byte_size` bytes
  // from its base. FAILED_PRECONDITION on an engine without GPUs.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpc(int device,
                                                                    const std::string& handle,
                                                                    uint64_t byte_size) {
    (void)device, (void)handle, (void)byte_size;
    return absl::FailedPreconditionError(
        "ipc_handle: this engine has no GPU to open CUDA IPC regions on (run verifyd with "
        "--engine=cuda)");
  }
  // Imports the chunks of a CUDA VMM allocation (POSIX file descriptors from
  // cuMemExportToShareableHandle, borrowed) on `device`, maps them whole and side by side into
  // one reserved range, readable and writable by the device, for a region of `byte_size` bytes
  // from `offset` into the first chunk. FAILED_PRECONDITION on an engine without GPUs.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> ImportCudaVmm(
      int device, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
      uint64_t offset, uint64_t byte_size) {
    (void)device, (void)fds, (void)chunk_bytes, (void)offset, (void)byte_size;
    return absl::FailedPreconditionError(
        "chunks: this engine has no GPU to import CUDA VMM allocations on (run verifyd with "
        "--engine=cuda)");
  }
  // Whether a path's output (reference or custom, already run on `b`) holds only finite values:
  // no NaN or Inf in o, no NaN or +Inf in lse (-Inf is the lse of a row that sees no key).
  // Checked where the output lives; the CUDA engine brings back only a flag.
  virtual absl::StatusOr<bool> AllFinite(Path path, PreparedBundle& b) = 0;
  // The outcome of the checks the engine made on the device (BundleView::indices_device: page
  // ids and mask bytes in a GPU's memory, checked as they were copied; the paths read the copy,
  // in which a bad page id reads page 0): OK, or INVALID_ARGUMENT naming the first bad entry as
  // ValidateBundle would. Known once a path's output was delivered, fetched or compared; OK for
  // a bundle checked on the host.
  virtual absl::Status InputChecks(PreparedBundle& b) {
    (void)b;
    return absl::OkStatus();
  }
  // AllFinite, and when the output is finite, Deliver: one wait on a GPU for both. A path whose
  // output is not finite may have been written into the regions already (the caller then
  // delivers another path's output over it).
  virtual absl::StatusOr<bool> DeliverIfFinite(Path path, PreparedBundle& b, const RegionRange& o,
                                               const RegionRange* lse);
  // Diff of path `test` against path `ref` (both already run on `b`).
  virtual absl::StatusOr<DiffStats> Compare(PreparedBundle& b, Path test, Path ref,
                                            const Tolerance& tol) = 0;
  // The bundle's inputs back on the host (captures). Off the critical path: called only when a
  // capture is written.
  virtual absl::StatusOr<std::shared_ptr<const OwnedBundle>> FetchInputs(PreparedBundle& b) {
    (void)b;
    return absl::UnimplementedError("this engine cannot return a bundle's inputs");
  }
  // Where a lost device is reported; set before the engine serves. Engines whose device cannot be
  // lost (the CPU engine) never call it.
  virtual void SetDeviceLostHandler(DeviceLostHandler handler) { (void)handler; }
  // Test-only: makes later Run(kCustom) calls fail or go wrong as `fault` says.
  virtual void InjectCustomFault(const CustomFault& fault) = 0;
};

}  // namespace verifyd
