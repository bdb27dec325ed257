// libFuzzer entry of one target; VERIFYD_FUZZ_TARGET names its function in fuzz_targets.h.

#include <cstdio>
#include <cstdlib>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::Status st = verifyd::fuzz::VERIFYD_FUZZ_TARGET(data, size);
  if (st.code() == absl::StatusCode::kInternal) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    std::abort();
  }
  return 0;
}
