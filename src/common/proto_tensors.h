#pragma once
// Small helpers on verifyd.v1.Tensor messages, shared by the request codec and the channel
// modes that build calls (doorbell_layout, tap_layout).

#include <cstdint>
#include <string>

#include "verifyd/v1/types.pb.h"

namespace verifyd {

// Bytes per element of a dtype; 0 for DTYPE_UNSPECIFIED or an unknown value.
inline int64_t DTypeBytes(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_F32:
    case v1::DTYPE_I32:
      return 4;
    case v1::DTYPE_U8:
    case v1::DTYPE_F8E4M3:
      return 1;
    default:
      return 0;
  }
}

// The tensor cut to its first `rows` rows (dimension 0); its region range shrinks to match.
inline void CutRows(v1::Tensor* t, int64_t rows) {
  t->set_shape(0, rows);
  int64_t bytes = DTypeBytes(t->dtype());
  for (int64_t d : t->shape()) bytes *= d;
  if (t->has_shm()) t->mutable_shm()->set_byte_size(static_cast<uint64_t>(bytes));
  if (t->has_cuda_ipc()) t->mutable_cuda_ipc()->set_byte_size(static_cast<uint64_t>(bytes));
}

// `n` int32 words as an inline tensor of shape [n].
inline void InlineI32(v1::Tensor* t, const int32_t* words, int64_t n) {
  t->set_dtype(v1::DTYPE_I32);
  t->clear_shape();
  t->add_shape(n);
  t->set_raw_contents(reinterpret_cast<const char*>(words), static_cast<size_t>(n) * 4);
}

}  // namespace verifyd
