#pragma once
// The CPU engine: the oracle, reference and custom paths on a fixed pool of worker threads,
// parallel over requests x head blocks. Runs everywhere; the embedded default without a GPU.

#include <memory>

#include "src/cpu_engine/cpu_custom.h"
#include "src/engine/engine.h"

namespace verifyd {

// threads: worker threads for the paths; 0 = the hardware's concurrency.
std::unique_ptr<Engine> MakeCpuEngine(int threads = 0, const CpuCustomConfig& custom = {});

}  // namespace verifyd
