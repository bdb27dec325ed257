#pragma once
// Elapsed time on the steady clock, in seconds: how every stage of a call is timed.

#include <chrono>

namespace verifyd {

inline double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace verifyd
