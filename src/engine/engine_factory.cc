#include "src/engine/engine_factory.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/cpu_engine/cpu_engine.h"
#ifdef VERIFYD_HAVE_CUDA
#include "src/cuda_engine/cuda_engine.h"
#endif

namespace verifyd {

bool HaveCudaEngine() {
#ifdef VERIFYD_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

namespace {

// Signs that the host (or the container) was given NVIDIA GPUs, whatever CUDA makes of them.
std::string GpuNodeSign() {
  std::error_code ec;
  if (std::filesystem::exists("/dev/nvidiactl", ec)) return "/dev/nvidiactl exists";
  if (std::filesystem::exists("/proc/driver/nvidia/version", ec)) {
    return "/proc/driver/nvidia/version exists";
  }
  const char* visible = std::getenv("NVIDIA_VISIBLE_DEVICES");
  if (visible != nullptr && *visible != '\0' && std::string(visible) != "void" &&
      std::string(visible) != "none") {
    return absl::StrCat("NVIDIA_VISIBLE_DEVICES=", visible);
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const EngineOptions& opts,
                                                   std::string* cpu_fallback) {
  if (cpu_fallback != nullptr) cpu_fallback->clear();
  if (opts.kind != "auto" && opts.kind != "cpu" && opts.kind != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("engine: '", opts.kind, "' is not one of auto, cpu, cuda"));
  }
#ifdef VERIFYD_HAVE_CUDA
  if (opts.kind == "cuda" || (opts.kind == "auto" && VisibleCudaDevices() > 0)) {
    if (VisibleCudaDevices() == 0) {
      return absl::FailedPreconditionError("engine: cuda requested but no GPU is visible");
    }
    CudaEngineOptions c;
    c.devices = opts.devices;
    c.memory_pool_bytes = static_cast<size_t>(opts.cuda_pool_bytes);
    c.sync_spin = absl::Microseconds(opts.cuda_sync_spin_us);
    c.custom = kernels::CustomConfigFromEnv();
    auto e = CudaEngine::Create(c);
    if (!e.ok()) return e.status();
    return std::unique_ptr<Engine>(std::move(*e));
  }
#else
  if (opts.kind == "cuda") {
    return absl::FailedPreconditionError("engine: this build has no CUDA engine (no nvcc)");
  }
#endif
  if (opts.kind == "auto" && cpu_fallback != nullptr) {
    if (const std::string sign = GpuNodeSign(); !sign.empty()) {
      *cpu_fallback = absl::StrCat(
          sign, ", but ",
          HaveCudaEngine() ? "no GPU is usable by CUDA" : "this build has no CUDA engine",
          "; serving from the CPU engine (pin --engine=cuda to refuse to start instead)");
    }
  }
  return MakeCpuEngine(opts.cpu_threads);
}

}  // namespace verifyd
