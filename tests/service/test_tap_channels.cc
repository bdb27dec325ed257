// Tap channels (src/channel/tap_layout.h) end to end over a Unix socket, with the test thread
// standing in for the tap kernel (kernels/tap/tap_kernel.cu): HostTap writes the same slot,
// record and header words, follows the same decision and ring rules, and never waits. Sampled
// calls are compared three ways, and a planted bug in the stack's output shows as a
// stack-vs-reference breach on exactly those calls; a full ring drops calls and counts them; a
// malformed fill is refused and counted and the channel goes on; a breach's capture holds the
// stack's output and replays bit for bit; a bad tap spec is refused naming the field; an e4m3
// pool is tapped at one byte an element with each call's scale in its record.

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <thread>

#include "kernels/tap/tap_abi.h"
#include "src/bundle/validate.h"
#include "src/channel/channel_layout.h"
#include "src/common/bf16.h"
#include "src/io/bundle_file.h"
#include "tests/service/daemon_fixture.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd::testing {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kMaxBatch = 3, kDraft = 5, kHeads = 5, kMaxPages = 40, kPage = 4;

uint32_t Load(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void Store(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The tap kernel on the host: one call per Call(), same words, same rules.
class HostTap {
 public:
  HostTap(char* region, char* channel, const v1::OpenChannelResponse& g)
      : region_(region), channel_(channel), g_(g) {}

  // One call of the stack: `v` its inputs, `stack_o` its output (bf16, o's shape). Returns
  // whether the call was copied into a slot. `edit`: changes the record before it is published
  // (a malformed fill).
  bool Call(const BundleView& v, const uint16_t* stack_o,
            const std::function<void(int32_t*)>& edit = nullptr) {
    auto* c = reinterpret_cast<tap::TapControl*>(region_);
    channel::Header* h = channel::HeaderOf(channel_);
    const uint32_t decision = Load(&c->decision);
    const bool filling = decision != 0 && decision != tap::kTapDrop;
    if (filling) {
      Fill(decision - 1, v, stack_o, c->calls);
      if (edit) edit(Record(decision - 1));
    }
    const uint32_t call = c->calls;
    c->calls = call + 1;
    if (decision == tap::kTapDrop) {
      ++c->taps;
      ++c->dropped;
    } else if (filling) {
      ++c->taps;
      ++c->produced;
      h->tap_produced.store(c->produced, std::memory_order_release);
    }
    const uint32_t ppm = Load(&c->sample_ppm);
    uint32_t next = 0;
    if (tap::TapSampled(call + 1, ppm)) {
      next = c->produced - Load(&c->consumed) >= g_slots() ? tap::kTapDrop
                                                           : c->produced % g_slots() + 1;
    }
    Store(&c->decision, next);
    h->tap_calls.store(c->calls, std::memory_order_relaxed);
    h->tap_taps.store(c->taps, std::memory_order_relaxed);
    h->tap_dropped.store(c->dropped, std::memory_order_relaxed);
    return filling;
  }

  int32_t* Record(uint32_t slot) {
    return reinterpret_cast<int32_t*>(channel_ + g_.request_offset() +
                                      slot * g_.tap_record_bytes());
  }

 private:
  uint32_t g_slots() const {
    return static_cast<uint32_t>((g_.tap_region_bytes() - g_.tap_slot_offset()) /
                                 g_.tap_slot_bytes());
  }
  void Fill(uint32_t slot, const BundleView& v, const uint16_t* stack_o, uint32_t call) {
    char* s = region_ + g_.tap_slot_offset() + slot * g_.tap_slot_bytes();
    std::memcpy(s, v.q, v.q_elems() * 2);
    std::memcpy(s + g_.tap_o_offset(), stack_o, v.o_elems() * 2);
    const int64_t batch = v.shape.batch, pages = v.kv_indptr[batch];
    const size_t page_bytes = static_cast<size_t>(v.shape.page_size) * 576 * v.kv_elem_bytes();
    for (int64_t p = 0; p < pages; ++p) {
      std::memcpy(s + g_.tap_kv_offset() + p * page_bytes,
                  reinterpret_cast<const char*>(v.kv_pool) + v.kv_indices[p] * page_bytes,
                  page_bytes);
    }
    int32_t* rec = Record(slot);
    rec[0] = static_cast<int32_t>(call);
    rec[1] = static_cast<int32_t>(batch);
    rec[2] = static_cast<int32_t>(pages);
    rec[3] = 0;
    std::memcpy(rec + tap::kTapRecordKvScale, &v.kv_scale, 4);
    std::memcpy(rec + tap::kTapRecordWords, v.kv_indptr, (batch + 1) * 4);
    std::memcpy(rec + tap::kTapRecordWords + kMaxBatch + 1, v.kv_lens, batch * 4);
    std::memcpy(rec + tap::kTapRecordWords + 2 * kMaxBatch + 1, v.tree_mask, v.mask_bytes());
  }

  char* region_;
  char* channel_;
  const v1::OpenChannelResponse g_;
};

RandomBundleSpec TapSpecBundle(uint64_t seed, int batch, int64_t prefix) {
  RandomBundleSpec s;
  s.batch = batch;
  s.draft = kDraft;
  s.heads = kHeads;
  s.prefix = prefix;
  s.page_size = kPage;
  s.seed = seed;
  s.extra_pages = 3;
  return s;
}

class TapTest : public DaemonTest {
 protected:
  void Start(const std::string& tag, bool capture = false) {
    dir_ = TestDir(tag);
    DaemonOptions o = TestOptions(dir_);
    o.handler.oracle_sample_rate = 0;
    o.channels.max_channels = 4;
    if (capture) {
      o.capture.dir = dir_ + "/captures";
      o.capture.min_breach_interval_seconds = 0;
      o.capture.min_free_bytes = 0;
    }
    StartDaemon(std::move(o));
    unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
  }

  v1::TapSpec Spec(uint32_t slots) const {
    v1::TapSpec t;
    t.set_backend("test_stack");
    t.set_region("taps");
    t.set_slots(slots);
    t.set_max_batch(kMaxBatch);
    t.set_draft(kDraft);
    t.set_heads(kHeads);
    t.set_max_pages(kMaxPages);
    t.set_page_size(kPage);
    t.set_sm_scale(RandomBundle(TapSpecBundle(1, 1, 8)).view().sm_scale);
    return t;
  }

  // Registers the slots region and opens the channel; the region starts zeroed, as the client
  // allocates it.
  grpc::Status OpenTap(const v1::TapSpec& spec, v1::OpenChannelResponse* g,
                       uint64_t region_bytes = 0) {
    const tap::TapSlotGeometry geo =
        tap::TapGeometry(kMaxBatch, kDraft, kHeads, kMaxPages, kPage, false,
                         spec.kv_dtype() == v1::DTYPE_F8E4M3 ? 1 : 2);
    if (region_bytes == 0) region_bytes = geo.SlotOffset(spec.slots());
    tap_.reset();
    chan_.reset();
    region_.reset();  // its name goes before the new object takes it
    region_ = std::make_unique<ShmObject>("taps", region_bytes);
    std::memset(region_->data(), 0, region_bytes);
    v1::RegisterShmRegionRequest reg;
    reg.set_name("taps");
    reg.set_key(region_->key());
    reg.set_byte_size(region_bytes);
    v1::RegisterRegionResponse rr;
    {
      grpc::ClientContext ctx;
      grpc::Status st = unix_->RegisterShmRegion(&ctx, reg, &rr);
      if (!st.ok()) return st;
    }
    chan_ = std::make_unique<ShmObject>("tapchan", 1 << 18);
    v1::OpenChannelRequest req;
    req.set_name("tap");
    req.set_key(chan_->key());
    req.set_byte_size(chan_->size());
    *req.mutable_tap() = spec;
    grpc::ClientContext ctx;
    grpc::Status st = unix_->OpenChannel(&ctx, req, g);
    if (st.ok()) tap_ = std::make_unique<HostTap>(region_->data(), chan_->data(), *g);
    return st;
  }

  // Waits until verifyd has finished with every published fill; false on a timeout.
  bool Drain() {
    channel::Header* h = channel::HeaderOf(chan_->data());
    for (int i = 0; i < 3000; ++i) {
      if (h->tap_consumed.load() == h->tap_produced.load()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  // The stack's output for `v`: the reference's (the daemon serves it in shadow mode), scaled by
  // 1.05 when `planted`.
  std::vector<uint16_t> StackOutput(const BundleView& v, bool planted) {
    v1::VerifyRequest req;
    EncodeRequest(v, &req);
    v1::VerifyResponse resp;
    EXPECT_TRUE(Verify(req, &resp).ok());
    std::vector<uint16_t> o(v.o_elems());
    EXPECT_EQ(resp.o().raw_contents().size(), o.size() * 2);
    std::memcpy(o.data(), resp.o().raw_contents().data(), o.size() * 2);
    if (planted) {
      for (uint16_t& x : o) x = FloatToBf16(Bf16ToFloat(x) * 1.05f);
    }
    return o;
  }

  v1::TapInfo Tap() {
    const v1::GetStatusResponse s = Status();
    EXPECT_EQ(s.channels_size(), 1);
    return s.channels_size() == 1 ? s.channels(0).tap() : v1::TapInfo();
  }

  std::string dir_;
  std::unique_ptr<v1::VerifyService::Stub> unix_;
  std::unique_ptr<ShmObject> region_, chan_;
  std::unique_ptr<HostTap> tap_;
};

// Every sampled call is compared three ways. The stack's output with a planted bug breaches
// against the reference on those calls and no other; custom stays within tolerance.
TEST_F(TapTest, SampledCallsAreComparedThreeWaysAndAPlantedBugShowsOnItsCalls) {
  Start("three_way");
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(Spec(4), &g).ok());
  EXPECT_EQ(g.tap_record_bytes() % 64, 0u);
  std::vector<std::unique_ptr<RandomBundle>> bundles;
  for (auto [seed, batch, prefix] :
       {std::tuple{11u, 3, 17}, std::tuple{12u, 1, 30}, std::tuple{13u, 2, 9}}) {
    bundles.push_back(std::make_unique<RandomBundle>(TapSpecBundle(seed, batch, prefix)));
  }
  const std::set<int> planted = {4, 9};
  int filled = 0, planted_filled = 0;
  for (int call = 0; call < 12; ++call) {
    const BundleView& v = bundles[call % 3]->view();
    const std::vector<uint16_t> o = StackOutput(v, planted.count(call) > 0);
    const bool f = tap_->Call(v, o.data());
    filled += f;
    planted_filled += f && planted.count(call) > 0;
    ASSERT_TRUE(Drain());  // one at a time: nothing is dropped
  }
  // The rate (1 by default) reached the control block at open; the first call's decision was
  // made before any call, so it is not sampled.
  EXPECT_EQ(filled, 11);
  EXPECT_EQ(planted_filled, 2);
  const v1::TapInfo t = Tap();
  EXPECT_EQ(t.backend(), "test_stack");
  EXPECT_EQ(t.kv_dtype(), "bf16");
  EXPECT_EQ(t.calls(), 12);
  EXPECT_EQ(t.taps(), 11);
  EXPECT_EQ(t.dropped(), 0);
  EXPECT_EQ(t.compared(), 11);
  EXPECT_EQ(t.refused(), 0);
  EXPECT_EQ(t.stack_breaches(), 2);
  EXPECT_GT(t.worst_stack_vs_reference(), 0.02);
  EXPECT_LT(t.worst_custom_vs_reference(), 0.01);
  EXPECT_GT(t.worst_custom_vs_stack(), 0.02);
  const std::string m = Scrape(daemon_->metrics_port());
  EXPECT_EQ(
      MetricValue(m,
                  "verifyd_tap_breaches_total{backend=\"test_stack\",pair=\"stack_vs_reference\"}"),
      2);
  EXPECT_EQ(
      MetricValue(
          m, "verifyd_tap_breaches_total{backend=\"test_stack\",pair=\"custom_vs_reference\"}"),
      0);
  EXPECT_EQ(MetricValue(m, "verifyd_tap_events_total{backend=\"test_stack\",event=\"compared\"}"),
            11);
  // A rate of 0 stops the sampling, within a call of verifyd writing it.
  {
    v1::SetSamplingRequest req;
    req.set_mode(v1::MODE_SHADOW);
    req.set_rate(0);
    req.set_reason("stop sampling");
    v1::SetSamplingResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->SetSampling(&ctx, req, &resp).ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const std::vector<uint16_t> o = StackOutput(bundles[0]->view(), false);
  tap_->Call(bundles[0]->view(), o.data());  // decided under the old rate
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(tap_->Call(bundles[0]->view(), o.data()));
}

// With one slot and verifyd busy, sampled calls find the ring full: they are dropped and
// counted, and the tap never waits. Every tap ends compared, refused or dropped.
TEST_F(TapTest, AFullRingDropsCallsCountsThemAndNeverWaits) {
  Start("full_ring");
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(Spec(1), &g).ok());
  RandomBundle b(TapSpecBundle(21, 3, 33));
  const std::vector<uint16_t> o = StackOutput(b.view(), false);
  const auto t0 = std::chrono::steady_clock::now();
  for (int call = 0; call < 200; ++call) tap_->Call(b.view(), o.data());
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 2.0) << "the tap waited";
  ASSERT_TRUE(Drain());
  const v1::TapInfo t = Tap();
  EXPECT_EQ(t.calls(), 200);
  EXPECT_EQ(t.taps(), 199);
  EXPECT_GT(t.dropped(), 0);
  EXPECT_GT(t.compared(), 0);
  EXPECT_EQ(t.taps(), t.compared() + t.refused() + t.dropped());
  const std::string m = Scrape(daemon_->metrics_port());
  EXPECT_EQ(MetricValue(m, "verifyd_tap_events_total{backend=\"test_stack\",event=\"dropped\"}"),
            t.dropped());
}

// A fill the tap marked malformed, or whose record is out of bounds or inconsistent, is refused
// and counted without a slot being read past its record's claims; the next fill is compared.
TEST_F(TapTest, MalformedFillsAreRefusedCountedAndTheChannelGoesOn) {
  Start("malformed");
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(Spec(2), &g).ok());
  RandomBundle b(TapSpecBundle(31, 2, 21));
  const BundleView& v = b.view();
  const std::vector<uint16_t> o = StackOutput(v, false);
  tap_->Call(v, o.data());  // the first call is never sampled
  ASSERT_TRUE(tap_->Call(v, o.data()));
  ASSERT_TRUE(Drain());
  const int32_t pages = v.kv_indptr[2];
  struct Bad {
    const char* what;
    std::function<void(int32_t*)> write;
  };
  const std::vector<Bad> bad = {
      {"flags", [](int32_t* r) { r[3] = static_cast<int32_t>(tap::kTapMalformed); }},
      {"batch past max", [](int32_t* r) { r[1] = kMaxBatch + 1; }},
      {"batch 0", [](int32_t* r) { r[1] = 0; }},
      {"pages past max", [](int32_t* r) { r[2] = kMaxPages + 1; }},
      {"indptr not ending at pages", [pages](int32_t* r) { r[2] = pages - 1; }},
      {"decreasing indptr", [](int32_t* r) { r[tap::kTapRecordWords + 1] = -5; }},
      {"length past the pages", [](int32_t* r) { r[tap::kTapRecordWords + kMaxBatch + 1] = 4000; }},
  };
  for (const Bad& x : bad) {  // a good call's record with one word broken
    ASSERT_TRUE(tap_->Call(v, o.data(), x.write)) << x.what;
    ASSERT_TRUE(Drain()) << x.what;
  }
  ASSERT_TRUE(tap_->Call(v, o.data()));
  ASSERT_TRUE(Drain());
  const v1::TapInfo t = Tap();
  EXPECT_EQ(t.refused(), static_cast<int64_t>(bad.size()));
  EXPECT_EQ(t.compared(), 2);
  v1::VerifyResponse resp;
  EXPECT_TRUE(Verify(SmallRequest(5), &resp).ok()) << "the daemon stopped serving";
}

// A breach of the stack's output is captured with the stack's output as a third output; the
// capture replays bit for bit like any other.
TEST_F(TapTest, ABreachCaptureHoldsTheStackOutputAndReplaysBitForBit) {
  Start("capture", /*capture=*/true);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(Spec(2), &g).ok());
  RandomBundle b(TapSpecBundle(41, 3, 13));
  const BundleView& v = b.view();
  const std::vector<uint16_t> clean = StackOutput(v, false);
  const std::vector<uint16_t> planted = StackOutput(v, true);
  tap_->Call(v, clean.data());
  ASSERT_TRUE(tap_->Call(v, planted.data()));
  ASSERT_TRUE(Drain());
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir_ + "/captures")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  auto f = LoadBundleFile(files[0].string());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata().at("stack_backend"), "test_stack");
  EXPECT_EQ(f->metadata().at("request_id"), "tap:test_stack:1");
  const int64_t n = f->view.o_elems();
  ASSERT_EQ(n, v.o_elems());
  ASSERT_NE(f->Find("o_stack"), nullptr);
  EXPECT_EQ(0, std::memcmp(f->Find("o_stack")->data.data(), planted.data(), n * 2));
  ASSERT_TRUE(ValidateBundle(f->view).ok());
  auto engine = LocalEngine();
  auto p = engine->Prepare(f->view, false);
  ASSERT_TRUE(p.ok()) << p.status();
  for (auto [path, name] :
       {std::pair{Path::kReference, "o_reference"}, std::pair{Path::kCustom, "o_custom"}}) {
    ASSERT_TRUE(engine->Run(path, **p).ok());
    PathOutput out;
    ASSERT_TRUE(engine->Fetch(path, **p, &out).ok());
    EXPECT_EQ(0, std::memcmp(out.o.data(), f->Find(name)->data.data(), n * 2)) << name;
  }
  // The clean stack output is the reference's, bit for bit.
  EXPECT_EQ(0, std::memcmp(clean.data(), f->Find("o_reference")->data.data(), n * 2));
}

// A bad tap spec or a region too small for it is refused naming the field.
TEST_F(TapTest, BadSpecsAreRefusedNamingTheField) {
  Start("bad_spec");
  struct Case {
    std::function<void(v1::TapSpec*)> edit;
    const char* field;
    grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  };
  const std::vector<Case> cases = {
      {[](v1::TapSpec* t) { t->set_backend("Bad Name"); }, "tap.backend"},
      {[](v1::TapSpec* t) { t->set_slots(0); }, "tap.slots"},
      {[](v1::TapSpec* t) { t->set_max_batch(0); }, "tap.max_batch"},
      {[](v1::TapSpec* t) { t->set_page_size(0); }, "tap.page_size"},
      {[](v1::TapSpec* t) { t->set_sm_scale(-1); }, "tap.sm_scale"},
      {[](v1::TapSpec* t) { t->set_kv_dtype(v1::DTYPE_U8); }, "tap.kv_dtype"},
      {[](v1::TapSpec* t) { t->set_kv_dtype(static_cast<v1::DType>(77)); }, "tap.kv_dtype"},
      {[](v1::TapSpec* t) { t->set_region("nope"); }, "tap.region", grpc::StatusCode::NOT_FOUND},
  };
  for (const Case& c : cases) {
    v1::TapSpec spec = Spec(2);
    c.edit(&spec);
    v1::OpenChannelResponse g;
    const grpc::Status st = OpenTap(spec, &g);
    EXPECT_EQ(st.error_code(), c.code) << c.field;
    EXPECT_NE(st.error_message().find(c.field), std::string::npos) << st.error_message();
    v1::UnregisterRegionRequest un;
    un.set_name("taps");
    v1::UnregisterRegionResponse unr;
    grpc::ClientContext ctx;
    ASSERT_TRUE(unix_->UnregisterRegion(&ctx, un, &unr).ok());
  }
  v1::OpenChannelResponse g;
  const grpc::Status st = OpenTap(Spec(2), &g, 4096);
  EXPECT_NE(st.error_message().find("tap.region"), std::string::npos) << st.error_message();
}

// An e4m3 pool is tapped at one byte an element, each call's scale in its record: the calls are
// compared (the stack's output being the reference's, a planted bug breaching on its calls
// only), at two scales in one channel; a record whose scale is not a finite positive float is
// refused and counted, and the channel goes on.
TEST_F(TapTest, AnE4m3PoolIsTappedWithEachCallsScale) {
  Start("e4m3");
  v1::TapSpec spec = Spec(2);
  spec.set_kv_dtype(v1::DTYPE_F8E4M3);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(spec, &g).ok());
  const tap::TapSlotGeometry bf16 =
      tap::TapGeometry(kMaxBatch, kDraft, kHeads, kMaxPages, kPage, false, 2);
  EXPECT_EQ(g.tap_slot_bytes(), bf16.slot_bytes - tap::TapAlignUp(bf16.kv_bytes) +
                                    tap::TapAlignUp(uint64_t{kMaxPages} * kPage * 576));
  std::vector<std::unique_ptr<RandomBundle>> bundles;
  for (auto [seed, batch, prefix, scale] :
       {std::tuple{61u, 3, 17, 0.37f}, std::tuple{62u, 2, 30, 2.5f}}) {
    RandomBundleSpec s = TapSpecBundle(seed, batch, prefix);
    s.kv_dtype = kernels::KvDtype::kE4m3;
    s.kv_scale = scale;
    bundles.push_back(std::make_unique<RandomBundle>(s));
  }
  const std::set<int> planted = {3, 6};
  int planted_filled = 0, filled = 0;
  for (int call = 0; call < 8; ++call) {
    const BundleView& v = bundles[call % 2]->view();
    ASSERT_EQ(v.shape.kv_dtype, kernels::KvDtype::kE4m3);
    const std::vector<uint16_t> o = StackOutput(v, planted.count(call) > 0);
    const bool f = tap_->Call(v, o.data());
    filled += f;
    planted_filled += f && planted.count(call) > 0;
    ASSERT_TRUE(Drain());
  }
  EXPECT_EQ(filled, 7);
  EXPECT_EQ(planted_filled, 2);
  v1::TapInfo t = Tap();
  EXPECT_EQ(t.kv_dtype(), "e4m3");
  EXPECT_EQ(t.compared(), 7);
  EXPECT_EQ(t.refused(), 0);
  EXPECT_EQ(t.stack_breaches(), 2);
  EXPECT_LT(t.worst_custom_vs_reference(), 0.01);
  // The record's scale is what the call is judged with: the wrong one breaches.
  const BundleView& v = bundles[0]->view();
  const std::vector<uint16_t> o = StackOutput(v, false);
  const float wrong = 0.5f;
  ASSERT_TRUE(tap_->Call(
      v, o.data(), [wrong](int32_t* r) { std::memcpy(r + tap::kTapRecordKvScale, &wrong, 4); }));
  ASSERT_TRUE(Drain());
  EXPECT_EQ(Tap().stack_breaches(), 3);
  for (float bad : {0.f, -1.f, std::nanf(""), INFINITY}) {
    ASSERT_TRUE(tap_->Call(
        v, o.data(), [bad](int32_t* r) { std::memcpy(r + tap::kTapRecordKvScale, &bad, 4); }));
    ASSERT_TRUE(Drain());
  }
  t = Tap();
  EXPECT_EQ(t.refused(), 4);
  EXPECT_EQ(t.compared(), 8);
  ASSERT_TRUE(tap_->Call(v, o.data()));
  ASSERT_TRUE(Drain());
  EXPECT_EQ(Tap().compared(), 9);
  v1::VerifyResponse resp;
  EXPECT_TRUE(Verify(SmallRequest(5), &resp).ok()) << "the daemon stopped serving";
}

// A tapped deployment's gate also needs a window of tapped comparisons, and custom no further
// from the stack's output than the reference is (within --tap_gate_ratio and --tap_gate_slack).
TEST_F(TapTest, TheGateNeedsCustomToAgreeWithTheStackAsWellAsTheReference) {
  dir_ = TestDir("gate");
  DaemonOptions o = TestOptions(dir_);
  o.handler.oracle_sample_rate = 0;
  o.controller.gate_window = 2;
  o.controller.tap_gate_window = 3;
  o.controller.tap_gate_ratio = 1;
  o.controller.tap_gate_slack = 0;  // the stack is the reference: only an exact custom passes
  StartDaemon(std::move(o));
  unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenTap(Spec(2), &g).ok());
  RandomBundle b(TapSpecBundle(51, 2, 25));
  const std::vector<uint16_t> stack = StackOutput(b.view(), false);  // the reference's output
  tap_->Call(b.view(), stack.data());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(tap_->Call(b.view(), stack.data()));
    ASSERT_TRUE(Drain());
  }
  v1::GetStatusResponse s = Status();
  EXPECT_FALSE(s.gate().ready());
  EXPECT_NE(s.gate().reason().find("2 of 3 tapped comparisons"), std::string::npos)
      << s.gate().reason();
  ASSERT_TRUE(tap_->Call(b.view(), stack.data()));
  ASSERT_TRUE(Drain());
  s = Status();
  EXPECT_FALSE(s.gate().ready());
  EXPECT_NE(s.gate().reason().find("tapped: custom's mean rel-L2 against the stack's output"),
            std::string::npos)
      << s.gate().reason();
  const grpc::Status flip = SetMode(v1::MODE_CUSTOM, /*force=*/false);
  EXPECT_EQ(flip.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(flip.error_message().find("tapped"), std::string::npos) << flip.error_message();
}

}  // namespace
}  // namespace verifyd::testing
