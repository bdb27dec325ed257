// The capturer over real files: unfinished writes left by a crash, failed writes, quotas.

#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/capture/capturer.h"
#include "src/io/bundle_file.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;

ComparisonRecord Record(uint64_t seed) {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 3;
  spec.heads = 8;
  spec.prefix = 40;
  spec.page_size = 16;
  spec.seed = seed;
  RandomBundle b(spec);
  ComparisonRecord r;
  r.bundle = std::make_shared<OwnedBundle>(b.view());
  r.request_id = "r" + std::to_string(seed);
  return r;
}

CaptureOptions Options(const std::string& dir) {
  CaptureOptions o;
  o.dir = dir;
  o.min_free_bytes = 0;
  o.min_breach_interval_seconds = 0;
  return o;
}

int CountEndingWith(const std::string& dir, const std::string& what) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    n += e.path().filename().string().find(what) != std::string::npos;
  }
  return n;
}

// Makes every write past `bytes` fail (EFBIG) for the life of the object.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = signal(SIGXFSZ, SIG_IGN);
    rlimit r = saved_;
    r.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &r);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_;
  sighandler_t old_handler_;
};

TEST(CapturerTest, TheUnfinishedFilesOfAKilledWriterAreRemovedAtStart) {
  const std::string dir = testing::TestDir("capturer");
  {
    auto c = Capturer::Create(Options(dir), "test");
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Write(Record(1), "requested").ok());
  }
  // What kill -9 in the middle of SaveBundleFile leaves behind.
  std::ofstream(dir + "/20260101T000000-000002-breach.safetensors.tmp.a1B2c3") << "partial";
  std::ofstream(dir + "/20260101T000000-000003-breach.safetensors.tmp.Zz9yX8") << "partial";
  std::ofstream(dir + "/notes.txt") << "not ours";
  auto c = Capturer::Create(Options(dir), "test");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(CountEndingWith(dir, ".tmp."), 0);
  EXPECT_EQ(CountEndingWith(dir, ".safetensors"), 1);
  EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
  EXPECT_EQ((*c)->Status().files, 1);
}

TEST(CapturerTest, ARequestedCaptureThatIsNotWrittenKeepsItsSlot) {
  const std::string dir = testing::TestDir("capturer");
  CaptureOptions o = Options(dir);
  o.max_bytes = 1000;  // smaller than any bundle
  auto c = Capturer::Create(o, "test");
  ASSERT_TRUE(c.ok());
  (*c)->RequestNext(2);
  const std::string trigger = (*c)->Claim(false);
  ASSERT_EQ(trigger, "requested");
  EXPECT_EQ((*c)->Status().pending, 1);
  absl::StatusOr<std::string> w = (*c)->Write(Record(2), trigger);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*c)->Status().pending, 2);
  EXPECT_EQ((*c)->Status().dropped, 1);
}

TEST(CapturerTest, AFailedWriteSaysWhyOnceLeavesNoFileAndKeepsTheSlot) {
  const std::string dir = testing::TestDir("capturer");
  auto c = Capturer::Create(Options(dir), "test");
  ASSERT_TRUE(c.ok());
  (*c)->RequestNext(1);
  const std::string trigger = (*c)->Claim(false);
  ASSERT_EQ(trigger, "requested");
  absl::StatusOr<std::string> w;
  {
    FileSizeLimit limit(4096);  // the disk "fills" after 4 KiB
    w = (*c)->Write(Record(3), trigger);
  }
  ASSERT_FALSE(w.ok());
  const std::string msg(w.status().message());
  const std::string why = std::strerror(EFBIG);
  ASSERT_NE(msg.find(why), std::string::npos) << msg;
  EXPECT_EQ(msg.find(why), msg.rfind(why)) << "the reason repeats: " << msg;
  EXPECT_EQ(CountEndingWith(dir, ".safetensors"), 0);
  EXPECT_EQ((*c)->Status().pending, 1);
  // The slot is used by the next write that succeeds.
  ASSERT_EQ((*c)->Claim(false), "requested");
  EXPECT_TRUE((*c)->Write(Record(4), "requested").ok());
  EXPECT_EQ((*c)->Status().pending, 0);
  EXPECT_EQ((*c)->Status().written, 1);
}

TEST(CapturerTest, TheFileQuotaHoldsWhileWriting) {
  const std::string dir = testing::TestDir("capturer");
  CaptureOptions o = Options(dir);
  o.max_files = 2;
  auto c = Capturer::Create(o, "test");
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*c)->Write(Record(10 + i), "requested").ok());
  EXPECT_EQ(CountEndingWith(dir, ".safetensors"), 2);
  EXPECT_EQ((*c)->Status().files, 2);
}

}  // namespace
}  // namespace verifyd
