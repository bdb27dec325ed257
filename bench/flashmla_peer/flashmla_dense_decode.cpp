// A Python module over FlashMLA's dense decode alone (its sm90 bf16 kernel, the scheduler
// metadata and the split combine), for timing it beside verifyd's kernel. build.py compiles
// this with FlashMLA's sources; the entry point is FlashMLA's own.
#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashMLA dense decode (benchmark peer)";
  m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
