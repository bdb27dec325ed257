#pragma once
// OCP FP8 E4M3 ("e4m3fn", torch.float8_e4m3fn), the element type of an fp8 KV pool: a sign, 4
// exponent bits with bias 7, 3 mantissa bits; exponent 0 holds the subnormals (m/8 * 2^-6); no
// infinity; S.1111.111 is NaN; the largest finite magnitude is 448. Every e4m3 value is exact in
// bf16 and in fp32. A pool's value is E4m3ToFloat(byte) * kv_scale (verify.proto).
// Host and device code share these (plain C++ where nvcc does not compile them).

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace verifyd::kernels {

VERIFYD_HOST_DEVICE inline float E4m3ToFloat(uint8_t x) {
  const int exponent = (x >> 3) & 0xf, mantissa = x & 7;
  float magnitude;
  if (exponent == 0xf && mantissa == 7) {
    magnitude = __builtin_nanf("");
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0.001953125f;  // m/8 * 2^-6
  } else {
    // (8 + m) * 2^(e - 10), built from its bits: exact.
    const float unit = static_cast<float>(1 << exponent) * 0.0009765625f;  // 2^(e - 10)
    magnitude = static_cast<float>(8 + mantissa) * unit;
  }
  return (x & 0x80) ? -magnitude : magnitude;
}

// The nearest e4m3 value (ties to even); NaN for NaN; magnitudes past 448 saturate to ±448, as
// torch's saturating casts do (a plain `.to(torch.float8_e4m3fn)` gives NaN there instead).
VERIFYD_HOST_DEVICE inline uint8_t FloatToE4m3(float f) {
  if (f != f) return 0x7f;
  const uint8_t sign = copysignf(1.f, f) < 0 ? 0x80 : 0;  // -0 keeps its sign
  float a = f < 0 ? -f : f;
  if (a >= 464.f) return sign | 0x7e;  // 448 is 0x7e; halfway to the next step (480) rounds down
  // Find the binade: a in [2^(e-7), 2^(e-6)) for exponent field e >= 1, else subnormal.
  int e = 1;
  float low = 0.015625f;  // 2^-6, the smallest normal
  if (a < low) {
    // Subnormal: steps of 2^-9.
    float q = a * 512.f;
    int m = static_cast<int>(q);
    const float r = q - static_cast<float>(m);
    if (r > 0.5f || (r == 0.5f && (m & 1))) ++m;
    return sign | static_cast<uint8_t>(m);  // m == 8 is the smallest normal, 0x08
  }
  while (e < 15 && a >= low * 2.f) {
    low *= 2.f;
    ++e;
  }
  const float q = a / low * 8.f;  // in [8, 16)
  int m = static_cast<int>(q);
  const float r = q - static_cast<float>(m);
  if (r > 0.5f || (r == 0.5f && (m & 1))) ++m;
  if (m == 16) {
    m = 8;
    ++e;
  }
  if (e == 15 && m - 8 == 7) return sign | 0x7e;  // not NaN: 448 at most
  return sign | static_cast<uint8_t>((e << 3) | (m - 8));
}

// Widening to bf16 by bits (the custom kernel's v3e, device_primitives.cuh, does it two codes at a
// time): a code's bits s eeee mmm placed as the bf16 s 0000eeee mmm0000 are its value times
// 2^-120, subnormals included, since a bf16 exponent field of 0 is subnormal with the same
// mantissa steps; multiplying by kE4m3WidenScaleBf16 (2^120) gives the value exactly. The NaN
// codes (s 1111 111) must be made NaN apart: as bits they are 480.
inline constexpr uint16_t kE4m3WidenScaleBf16 = 0x7b80;  // 2^120
VERIFYD_HOST_DEVICE constexpr uint16_t E4m3WidenBits(uint8_t x) {
  return static_cast<uint16_t>(((x & 0x7fu) << 4) | ((x & 0x80u) << 8));
}

}  // namespace verifyd::kernels
