#pragma once
// Median device time of a launch sequence, measured with CUDA events around each launch.

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

namespace verifyd::bench {

// Runs `launch(i)` `warmup` times, then `reps` times each between two events on `stream`.
// Returns the median in milliseconds, or -1 when a launch or event call fails.
template <typename Launch>
double MedianMs(cudaStream_t stream, int warmup, int reps, Launch launch) {
  for (int i = 0; i < warmup; ++i) {
    if (launch(i) != cudaSuccess) return -1;
  }
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) {
    if (cudaEventCreate(&e) != cudaSuccess) return -1;
  }
  bool ok = true;
  for (int i = 0; i < reps && ok; ++i) {
    ok = cudaEventRecord(ev[2 * i], stream) == cudaSuccess && launch(warmup + i) == cudaSuccess &&
         cudaEventRecord(ev[2 * i + 1], stream) == cudaSuccess;
  }
  ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
  std::vector<float> ms(reps, 0.f);
  for (int i = 0; i < reps && ok; ++i) {
    ok = cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]) == cudaSuccess;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  if (!ok) return -1;
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[reps / 2];
}

}  // namespace verifyd::bench
