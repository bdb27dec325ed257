#pragma once
// Host mappings of shared-memory objects that a client owns. The client can shrink its object
// (ftruncate) while verifyd maps it, and touching a page past the new end raises SIGBUS, which
// would kill the daemon. A guarded mapping is instead replaced, at its first such fault, by
// anonymous zero pages over its whole range; the access goes on and the mapping is marked
// broken. Whoever read it checks MappingBroken() and fails the call: the bytes it read mean
// nothing. (Wayland compositors guard their clients' shm pools this way.)
//
// A fault is handled only while the mapping is guarded, and verifyd touches a region's memory
// only in calls that pin it, so the mapping cannot be unmapped under a fault. Faults outside
// guarded mappings go to the SIGBUS disposition that was there before.

#include <cstddef>

#include "absl/status/statusor.h"

namespace verifyd {

// Guards the page-aligned MAP_SHARED mapping [begin, begin + bytes). Returns the slot to pass to
// MappingBroken() and UnguardMapping(); RESOURCE_EXHAUSTED when all slots are taken.
absl::StatusOr<int> GuardMapping(void* begin, size_t bytes);
// Whether a fault replaced the mapping's pages.
bool MappingBroken(int slot);
// Call before the mapping is unmapped.
void UnguardMapping(int slot);

}  // namespace verifyd
