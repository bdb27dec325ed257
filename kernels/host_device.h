#pragma once
// VERIFYD_HOST_DEVICE: a function both the host and the device code call (plain C++ where nvcc
// does not compile it).

#if defined(__CUDACC__)
#define VERIFYD_HOST_DEVICE __host__ __device__
#else
#define VERIFYD_HOST_DEVICE
#endif
