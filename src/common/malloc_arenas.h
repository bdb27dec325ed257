#pragma once
// glibc gives a thread that finds the malloc arenas busy an arena of its own, up to eight per
// core, and memory freed into an arena mostly stays with the process. verifyd's gRPC and engine
// threads each allocate and free bundles of up to a GiB, so with the default its resident memory
// grows with the number of threads that ever handled one, far past the bundles in flight.
// Bounding the arenas keeps it near what is live. MALLOC_ARENA_MAX in the environment, which
// glibc reads itself, takes precedence. Call it first thing in main(), before threads start.

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

}  // namespace verifyd
