#pragma once
// The two hardware ceilings every benchmark row is measured against, taken in the same run:
// a large bf16 GEMM through cuBLAS (fp32 accumulation) and a large device-to-device copy.

#include <cublas_v2.h>

#include <cstdint>
#include <string>

namespace verifyd::bench {

struct Ceilings {
  double gemm_tflops = 0;  // 2*m*n*k / median time
  int gemm_mnk = 0;        // m = n = k
  double copy_gbps = 0;    // (bytes read + bytes written) / median time
  int64_t copy_bytes = 0;  // bytes copied per run
  std::string error;       // non-empty when a measurement failed
};

Ceilings MeasureCeilings(cublasHandle_t handle, int gemm_mnk = 8192,
                         int64_t copy_bytes = int64_t{2} << 30, int reps = 20);

}  // namespace verifyd::bench
