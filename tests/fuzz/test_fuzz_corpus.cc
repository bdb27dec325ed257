// Replays the fuzzers' seed corpus and every kept crashing input through the same entry points,
// without libFuzzer, so that the regular and the ASan/UBSan builds run them as tests. Seeds named
// bad_* must be refused and the other seeds accepted; kept crashing inputs must run through
// without breaking an invariant (INTERNAL).

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "gtest/gtest.h"
#include "tests/fuzz/fuzz_targets.h"

namespace verifyd::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = VERIFYD_FUZZ_DIR;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int Replay(const Target& t, const fs::path& dir, bool check_verdict) {
  if (!fs::exists(dir)) return 0;
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(entry.path().string());
    const std::string bytes = Slurp(entry.path());
    absl::Status st = t.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    EXPECT_NE(st.code(), absl::StatusCode::kInternal) << st;
    if (check_verdict) {
      EXPECT_EQ(st.ok(), name.rfind("bad_", 0) != 0) << st;
    }
    ++n;
  }
  return n;
}

class FuzzCorpus : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzCorpus, SeedsAreJudgedAsNamed) {
  EXPECT_GT(Replay(GetParam(), kFuzzDir / "corpus" / GetParam().name, true), 0);
}

TEST_P(FuzzCorpus, KeptCrashingInputsRunThrough) {
  const fs::path dir = kFuzzDir / "regressions" / GetParam().name;
  if (!fs::exists(dir)) GTEST_SKIP() << "no kept inputs for " << GetParam().name;
  EXPECT_GT(Replay(GetParam(), dir, false), 0) << dir << " holds no input";
}

// The kept inputs are found at all: a wrong path would make every target above skip.
TEST(FuzzCorpusKept, TheRegressionsFolderHoldsInputs) {
  int n = 0;
  for (const Target& t : Targets()) {
    const fs::path dir = kFuzzDir / "regressions" / t.name;
    if (!fs::exists(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  }
  EXPECT_GE(n, 8) << "kept crashing inputs under " << kFuzzDir / "regressions";
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus, ::testing::ValuesIn(Targets()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace verifyd::fuzz
