#pragma once
// The verify-attention problem as the kernels see it: sizes, limits and device pointers.
// Plain C++ (no CUDA types) so that the server's validation and the CPU engine share the
// one answer to "is this shape supported" with the kernels.

#include <cstdint>
#include <string>

namespace verifyd::kernels {

inline constexpr int kHeadDimQK = 576;  // 512 latent dims (W_UK absorbed) + 64 rope dims
inline constexpr int kHeadDimV = 512;   // V is the first 512 dims of each K row
inline constexpr int kMaxBatch = 256;
inline constexpr int kMaxDraft = 1024;
inline constexpr int kMaxHeads = 128;
inline constexpr int kMaxPageSize = 128;
inline constexpr int64_t kMaxPrefix = 128 * 1024;

// Tree mask layout. kBytes: uint8 [B, T, T], values 0/1. kBits: uint8 [B, T, ceil(T/8)],
// bit (j % 8) of byte j / 8 (little-endian bit order, numpy.packbits(bitorder="little")).
enum class MaskFormat : int { kBytes = 0, kBits = 1 };

inline int64_t MaskRowBytes(MaskFormat f, int draft) {
  return f == MaskFormat::kBytes ? draft : (draft + 7) / 8;
}

// The KV pool's element type. kE4m3: OCP FP8 E4M3 bytes (kernels/e4m3.h), each value times the
// bundle's kv_scale; q stays bf16 and the outputs keep their types.
enum class KvDtype : int { kBf16 = 0, kE4m3 = 1 };

inline int KvElemBytes(KvDtype d) { return d == KvDtype::kE4m3 ? 1 : 2; }
inline const char* KvDtypeName(KvDtype d) { return d == KvDtype::kE4m3 ? "e4m3" : "bf16"; }

// Sizes known on the host before any launch.
struct ProblemShape {
  int batch = 0;      // B
  int draft = 0;      // T, draft tokens per request
  int heads = 0;      // H, query heads
  int page_size = 0;  // tokens per KV page, power of two in [1, 128]
  int64_t num_pages = 0;
  int64_t num_indices = 0;  // kv_indptr[B]
  MaskFormat mask_format = MaskFormat::kBytes;
  KvDtype kv_dtype = KvDtype::kBf16;
};

// Returns "" when the shape is supported, else a one-line reason that starts with the field name
// ("heads: 0 is outside [1, 128]"). The server validates with this; the tests assert it.
std::string CheckShape(const ProblemShape& s);

// One launch's arguments. Pointers are device pointers for the CUDA paths, host pointers for
// the CPU paths.
struct VerifyProblem {
  ProblemShape shape;
  const uint16_t* q = nullptr;          // bf16 [B*T, H, 576]
  const uint16_t* kv_pool = nullptr;    // bf16 [num_pages, page_size, 576], or e4m3 bytes
                                        // when shape.kv_dtype is kE4m3 (see kv_scale)
  const int32_t* kv_indptr = nullptr;   // [B+1]
  const int32_t* kv_indices = nullptr;  // [kv_indptr[B]]
  const int32_t* kv_lens = nullptr;     // [B], prefix_len + T
  const uint8_t* tree_mask = nullptr;   // see MaskFormat
  float sm_scale = 0.f;
  float kv_scale = 1.f;      // kE4m3: each pool value is e4m3 x kv_scale
  float o_scale = 1.f;       // o's factor before its rounding: a dequantised e4m3 pool's kv_scale
                             // (the engines' bf16 copy of its values, kv_dtype kBf16), else 1
  int64_t max_kv_len = 0;    // host-side max over kv_lens (plans the KV split)
  int64_t total_kv_len = 0;  // host-side sum over kv_lens
  uint16_t* o = nullptr;     // bf16 [B*T, H, 512] out
  float* lse = nullptr;      // fp32 [B*T, H] out, optional (natural log)
};

}  // namespace verifyd::kernels
