#pragma once
// How verifyd uses glibc's malloc: bounded arenas and freed bundle memory kept for reuse.
//
// glibc gives a thread that finds the malloc arenas busy an arena of its own, up to eight per
// core, and memory freed into an arena mostly stays with the process. verifyd's gRPC and engine
// threads each allocate and free bundles of up to a GiB, so with the default its resident memory
// grows with the number of threads that ever handled one, far past the bundles in flight.
// Bounding the arenas keeps it near what is live. MALLOC_ARENA_MAX in the environment, which
// glibc reads itself, takes precedence. Call it first thing in main(), before threads start.

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace verifyd {

inline constexpr int kDefaultMallocArenas = 2;

inline void BoundMallocArenas(int max_arenas = kDefaultMallocArenas) {
#if defined(__GLIBC__)
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, max_arenas);
#else
  (void)max_arenas;
#endif
}

// Bundles are tens of MB. glibc serves a block over its mmap threshold (at most 32 MiB) with a
// fresh mmap and unmaps it on free, so each call faults its bundle's pages in again, in the
// parse, in every copy and in the client: on a VM, parsing one 38 MB message took 141 ms that
// way and 3 ms from reused memory. Serving large blocks from the heap, and keeping up to
// `keep_bytes` of freed memory at its top instead of trimming it, lets calls reuse warm pages;
// the process keeps about its peak working set resident. keep_bytes <= 0 leaves glibc's
// defaults. MALLOC_MMAP_MAX_ or MALLOC_TRIM_THRESHOLD_ in the environment take precedence.
inline constexpr int64_t kMaxKeepFreedMb = 2047;  // M_TRIM_THRESHOLD is an int
inline constexpr int64_t kDefaultKeepFreedMb = kMaxKeepFreedMb;

inline void KeepFreedMemory(int64_t keep_bytes) {
#if defined(__GLIBC__)
  if (keep_bytes <= 0) return;
  if (std::getenv("MALLOC_MMAP_MAX_") == nullptr) mallopt(M_MMAP_MAX, 0);
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) {
    mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<int64_t>(keep_bytes, INT32_MAX)));
  }
#else
  (void)keep_bytes;
#endif
}

}  // namespace verifyd
