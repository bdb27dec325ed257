#pragma once
// --engine=auto|cpu|cuda: CUDA when a GPU is visible (auto), else the embedded CPU engine.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/engine/engine.h"

namespace verifyd {

struct EngineOptions {
  std::string kind = "auto";  // auto, cpu, cuda
  int cpu_threads = 0;        // 0 = all cores
  std::vector<int> devices;   // CUDA devices; empty = all visible
  int64_t cuda_pool_bytes = int64_t{8} << 30;
  // CUDA: how long a wait for the served output polls before it sleeps (--cuda_sync_spin_us).
  int64_t cuda_sync_spin_us = 100;
};

// With `cpu_fallback`, says there why --engine=auto chose the CPU engine on a host that looks like
// a GPU node (NVIDIA device files, or NVIDIA_VISIBLE_DEVICES naming devices); empty otherwise.
absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const EngineOptions& opts,
                                                   std::string* cpu_fallback = nullptr);

// Whether this build has the CUDA engine.
bool HaveCudaEngine();

}  // namespace verifyd
