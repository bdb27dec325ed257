// Capture and replay, sampling, the oracle's noise floor: the operator's view of an experiment.

#include <filesystem>
#include <fstream>

#include "src/bundle/validate.h"
#include "src/io/bundle_file.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;
using testing::DaemonTest;

std::vector<fs::path> Captures(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

class CaptureTest : public DaemonTest {
 protected:
  DaemonOptions Options(const std::string& tag) {
    dir_ = testing::TestDir(tag);
    auto o = testing::TestOptions(dir_);
    o.capture.dir = dir_ + "/captures";
    o.capture.min_breach_interval_seconds = 0;
    o.capture.min_free_bytes = 0;
    return o;
  }
  std::string dir_;
};

TEST_F(CaptureTest, ABreachIsCapturedAndReplayReproducesTheRecordedComparisonExactly) {
  auto o = Options("capture");
  o.handler.tolerance.max_rel_l2 = 1e-4;  // tighter than bf16: every comparison breaches
  StartDaemon(o);
  v1::VerifyRequest req = testing::SmallRequest(21, 17, 97, 16);
  req.set_compare_sync(true);
  req.set_request_id("req-21");
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  ASSERT_FALSE(resp.comparison().match());
  auto files = Captures(dir_ + "/captures");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_NE(files[0].string().find("breach"), std::string::npos);

  auto f = LoadBundleFile(files[0].string());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(ValidateBundle(f->view).ok());
  const auto& m = f->metadata();
  EXPECT_EQ(m.at("outcome"), "breach");
  EXPECT_EQ(m.at("request_id"), "req-21");
  EXPECT_EQ(m.at("mode"), "shadow");
  EXPECT_EQ(std::stod(m.at("rel_l2")), resp.comparison().rel_l2());

  // The recorded outputs give the recorded comparison, to the last bit.
  const int64_t n = f->view.o_elems(), nl = f->view.lse_elems();
  Tolerance tol = o.handler.tolerance;
  DiffStats rec = CompareBf16(
      f->Find("o_custom")->as<uint16_t>(), f->Find("o_reference")->as<uint16_t>(), n,
      f->Find("lse_custom")->as<float>(), f->Find("lse_reference")->as<float>(), nl, tol);
  if (testing::TestEngine() == "cpu") {
    EXPECT_EQ(rec.rel_l2, resp.comparison().rel_l2());
  } else {
    // The CUDA engine reduces on the device in another order: equal up to the last bits.
    EXPECT_NEAR(rec.rel_l2, resp.comparison().rel_l2(), 1e-9 * resp.comparison().rel_l2());
  }
  EXPECT_EQ(rec.max_abs, resp.comparison().max_abs());
  EXPECT_EQ(rec.beyond_tol, resp.comparison().beyond_tol());

  // Re-running the paths on the captured bundle reproduces the recorded outputs bit for bit.
  auto engine = testing::LocalEngine();
  auto p = engine->Prepare(f->view, false);
  ASSERT_TRUE(p.ok());
  for (auto [path, name] :
       {std::pair{Path::kReference, "o_reference"}, std::pair{Path::kCustom, "o_custom"}}) {
    ASSERT_TRUE(engine->Run(path, **p).ok());
    PathOutput out;
    ASSERT_TRUE(engine->Fetch(path, **p, &out).ok());
    EXPECT_EQ(0, std::memcmp(out.o.data(), f->Find(name)->data.data(), n * 2)) << name;
  }
  // The served response is the recorded reference output.
  EXPECT_EQ(resp.o().raw_contents(),
            std::string(reinterpret_cast<const char*>(f->Find("o_reference")->data.data()), n * 2));
}

TEST_F(CaptureTest, TheQuotaHoldsUnderABurstOfBreaches) {
  auto o = Options("capture");
  o.handler.tolerance.max_rel_l2 = 1e-4;
  o.capture.max_files = 3;
  StartDaemon(o);
  v1::VerifyRequest req = testing::SmallRequest(22);
  req.set_compare_sync(true);
  for (int i = 0; i < 10; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
  }
  auto files = Captures(dir_ + "/captures");
  EXPECT_EQ(files.size(), 3u);
  // Oldest deleted first: the survivors are the last three written.
  EXPECT_NE(files.back().string().find("-000010-breach"), std::string::npos) << files.back();
  EXPECT_EQ(daemon_->capturer()->Status().written, 10);

  // A byte quota smaller than one bundle: nothing is written, nothing fills the disk.
  daemon_.reset();
  auto small = Options("capture_bytes");
  small.handler.tolerance.max_rel_l2 = 1e-4;
  small.capture.max_bytes = 1000;
  StartDaemon(small);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  EXPECT_TRUE(Captures(dir_ + "/captures").empty());
  EXPECT_EQ(daemon_->capturer()->Status().dropped, 1);
}

TEST_F(CaptureTest, BreachCapturesAreRateLimited) {
  auto o = Options("capture");
  o.handler.tolerance.max_rel_l2 = 1e-4;
  o.capture.min_breach_interval_seconds = 3600;
  StartDaemon(o);
  v1::VerifyRequest req = testing::SmallRequest(23);
  req.set_compare_sync(true);
  for (int i = 0; i < 4; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(req, &resp).ok());
  }
  EXPECT_EQ(Captures(dir_ + "/captures").size(), 1u);
  EXPECT_EQ(daemon_->capturer()->Status().dropped, 3);
}

TEST_F(CaptureTest, CaptureNextTakesTheNextNComparedCalls) {
  StartDaemon(Options("capture"));
  v1::CaptureRequest creq;
  creq.set_next(2);
  v1::CaptureResponse cresp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(admin_->Capture(&ctx, creq, &cresp).ok());
  EXPECT_EQ(cresp.capture().pending(), 2);
  for (int i = 0; i < 5; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(testing::SmallRequest(30 + i), &resp).ok());
  }
  daemon_->shadow().WaitIdle();
  auto files = Captures(dir_ + "/captures");
  ASSERT_EQ(files.size(), 2u);
  for (const auto& f : files) EXPECT_NE(f.string().find("requested"), std::string::npos);
  EXPECT_EQ(Status().capture().pending(), 0);
}

TEST_F(CaptureTest, ACaptureLoadsInPythonWithNumpy) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 with numpy is not installed";
  }
  auto o = Options("capture");
  o.handler.tolerance.max_rel_l2 = 1e-4;
  StartDaemon(o);
  v1::VerifyRequest req = testing::SmallRequest(24);
  req.set_compare_sync(true);
  v1::VerifyResponse resp;
  ASSERT_TRUE(Verify(req, &resp).ok());
  auto files = Captures(dir_ + "/captures");
  ASSERT_EQ(files.size(), 1u);
  const std::string script = dir_ + "/load.py";
  std::ofstream(script) << R"(
import json, struct, sys
import numpy as np
raw = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
head = json.loads(raw[8:8 + n])
body = raw[8 + n:]
def t(name, dt):
    a, b = head[name]['data_offsets']
    return np.frombuffer(body[a:b], dtype=dt).reshape(head[name]['shape'])
for name in ['q', 'kv_pool', 'kv_indptr', 'kv_indices', 'kv_lens', 'tree_mask', 'sm_scale',
             'o_reference', 'o_custom', 'lse_reference', 'lse_custom']:
    assert name in head, name
assert head['o_custom']['dtype'] == 'BF16' and head['kv_lens']['dtype'] == 'I32'
ref = (t('o_reference', '<u2').astype(np.uint32) << 16).view(np.float32)
cus = (t('o_custom', '<u2').astype(np.uint32) << 16).view(np.float32)
rel = float(np.linalg.norm((cus - ref).astype(np.float64)) / np.linalg.norm(ref.astype(np.float64)))
want = float(head['__metadata__']['rel_l2'])
assert abs(rel - want) <= 1e-12 * max(1.0, want), (rel, want)
assert list(t('kv_lens', '<i4')) == [57, 57]
print('ok')
)";
  EXPECT_EQ(std::system(("/usr/bin/python3 " + script + " " + files[0].string()).c_str()), 0);
}

TEST_F(CaptureTest, TheOracleShowsWhichPathIsWrong) {
  auto o = Options("capture");
  o.inject_custom_fault = {CustomFault::Kind::kPerturb, 0.05};
  o.handler.oracle_sample_rate = 1.0;
  StartDaemon(o);
  for (int i = 0; i < 3; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(testing::SmallRequest(40 + i), &resp).ok());
  }
  daemon_->shadow().WaitIdle();
  const auto r = Status().recent();
  EXPECT_EQ(r.oracle_samples(), 3);
  EXPECT_LT(r.reference_vs_oracle_rel_l2(), 4e-3);  // bf16 rounding only
  EXPECT_GT(r.custom_vs_oracle_rel_l2(), 2e-2);     // the injected error
  EXPECT_GT(r.custom_vs_oracle_rel_l2(), 10 * r.reference_vs_oracle_rel_l2());
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_diff_rel_l2_count{pair=\"custom_vs_oracle\"} 3"), std::string::npos);
}

TEST_F(CaptureTest, SamplingIsSetAtRunTimeAndPersisted) {
  StartDaemon(Options("capture"));
  v1::SetSamplingRequest sreq;
  sreq.set_mode(v1::MODE_SHADOW);
  sreq.set_rate(0.0);
  sreq.set_reason("test");
  v1::SetSamplingResponse sresp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->SetSampling(&ctx, sreq, &sresp).ok());
  }
  for (int i = 0; i < 5; ++i) {
    v1::VerifyResponse resp;
    ASSERT_TRUE(Verify(testing::SmallRequest(50), &resp).ok());
  }
  daemon_->shadow().WaitIdle();
  EXPECT_EQ(daemon_->handler().counters().comparisons_match(), 0);
  sreq.set_rate(1.5);
  grpc::ClientContext ctx;
  EXPECT_EQ(admin_->SetSampling(&ctx, sreq, &sresp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  daemon_.reset();
  StartDaemon(testing::TestOptions(dir_));  // same state dir
  EXPECT_EQ(Status().shadow_sample_rate(), 0.0);
}

}  // namespace
}  // namespace verifyd
