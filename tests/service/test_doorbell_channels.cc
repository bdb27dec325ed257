// Doorbell channels (src/channel/doorbell_layout.h) end to end over a Unix socket, with the
// test thread standing in for the client's GPU: it writes the same shared-memory words that
// cuStreamWriteValue32 and a device-to-host copy write, and waits on the done word as
// cuStreamWaitValue32 does. A call built from a descriptor and a layout slot gives the unary
// RPC's bytes for the same batch; every bad call gets a status in the done word, a zero-filled
// o_out and an error naming the field, and the channel goes on; opening with bad descriptors is
// refused naming the field; a client killed mid-call frees its channel.

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "src/channel/channel_layout.h"
#include "src/channel/doorbell_layout.h"
#include "tests/service/daemon_fixture.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd::testing {
namespace {

constexpr uint32_t kTimedOut = 0xffffffffu;

// The client's stream, on the host: ring, wait for the done bit, reset it. Returns the done word.
uint32_t Ring(char* base, channel::Ring r) {
  channel::Header* h = channel::HeaderOf(base);
  h->doorbell.store(channel::RingWord(r), std::memory_order_release);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  uint32_t done;
  while (((done = h->done.load(std::memory_order_acquire)) & channel::kDone) == 0) {
    if (std::chrono::steady_clock::now() > deadline) return kTimedOut;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  h->done.store(0, std::memory_order_relaxed);
  return done;
}

int DoneCode(uint32_t done) { return static_cast<int>(done >> 8 & 0xff); }

// The response verifyd left in the response area after the last call.
v1::VerifyResponse LastResponse(const char* base, const v1::OpenChannelResponse& g) {
  v1::VerifyResponse r;
  EXPECT_TRUE(r.ParseFromArray(base + g.response_offset(),
                               static_cast<int>(channel::HeaderOf(base)->response_bytes.load())));
  return r;
}

// Layout slot `slot`: batch, kv_indptr[0..batch], kv_lens[0..batch).
void WriteSlot(char* base, const v1::OpenChannelResponse& g, uint32_t slot, int32_t batch,
               const int32_t* indptr, const int32_t* lens, int32_t generation = 0) {
  auto* w = reinterpret_cast<int32_t*>(base + g.request_offset() + slot * g.layout_slot_bytes());
  const int64_t max_batch = g.max_batch();
  std::memset(w, 0x5a, g.layout_slot_bytes());  // what the call must not read
  w[0] = batch;
  w[1] = generation;
  if (batch >= 0 && batch <= max_batch) {
    std::memcpy(w + 2, indptr, (batch + 1) * 4);
    std::memcpy(w + 3 + max_batch, lens, batch * 4);
  }
}

// The first `batch` requests of an inline request: what a client sends for that batch alone.
v1::VerifyRequest FirstRequests(const v1::VerifyRequest& full, int64_t batch, int64_t draft) {
  v1::VerifyRequest r = full;
  auto cut = [](v1::Tensor* t, int64_t rows) {
    const size_t row_bytes = t->raw_contents().size() / t->shape(0);
    t->mutable_raw_contents()->resize(rows * row_bytes);
    t->set_shape(0, rows);
  };
  const auto* indptr = reinterpret_cast<const int32_t*>(full.kv_indptr().raw_contents().data());
  cut(r.mutable_q(), batch * draft);
  cut(r.mutable_tree_mask(), batch);
  cut(r.mutable_kv_lens(), batch);
  cut(r.mutable_kv_indptr(), batch + 1);
  cut(r.mutable_kv_indices(), indptr[batch]);
  return r;
}

class DoorbellTest : public DaemonTest {
 protected:
  void SetUp() override {
    dir_ = TestDir("doorbell");
    DaemonOptions o = TestOptions(dir_);
    o.handler.oracle_sample_rate = 0;
    o.channels.max_channels = 4;
    StartDaemon(std::move(o));
    unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
  }

  // A batch-3 bundle in region "pool", and two descriptors naming it: each writes o (and lse)
  // to its own place.
  void PutBundle(uint64_t seed, int page, int draft, int64_t prefix) {
    bundle_ = std::make_unique<RandomBundle>(RegionBundleSpec(seed, page, draft, prefix));
    const BundleView& v = bundle_->view();
    EncodeRequest(v, &inline_);
    inline_.set_want_lse(true);
    layout_ = ShmLayout::Of(v);
    shm_.reset();  // its name goes before the new object takes it
    shm_ = std::make_unique<ShmObject>("pool", 2 * layout_.end + 4096);
    v1::VerifyRequest in_shm = inline_;
    PutInShm(v, layout_, shm_->data(), "pool", &in_shm);
    in_shm.clear_kv_indptr();
    in_shm.clear_kv_lens();
    descriptors_.Clear();
    *descriptors_.Add() = in_shm;
    v1::VerifyRequest second = in_shm;  // its outputs past the first bundle's layout
    const ShmLayout l2 = ShmLayout::Of(v, layout_.end);
    second.mutable_o_out()->mutable_shm()->set_offset(l2.o);
    second.mutable_lse_out()->mutable_shm()->set_offset(l2.lse);
    *descriptors_.Add() = second;
    {  // a bundle put before this one
      v1::UnregisterRegionRequest un;
      un.set_name("pool");
      v1::UnregisterRegionResponse unr;
      grpc::ClientContext ctx;
      (void)unix_->UnregisterRegion(&ctx, un, &unr);
    }
    v1::RegisterShmRegionRequest req;
    req.set_name("pool");
    req.set_key(shm_->key());
    req.set_byte_size(shm_->size());
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(unix_->RegisterShmRegion(&ctx, req, &resp).ok());
  }

  grpc::Status Open(const std::string& name, const ShmObject& obj,
                    const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& descriptors,
                    uint32_t slots, v1::OpenChannelResponse* resp) {
    v1::OpenChannelRequest req;
    req.set_name(name);
    req.set_key(obj.key());
    req.set_byte_size(obj.size());
    *req.mutable_descriptors() = descriptors;
    req.set_layout_slots(slots);
    grpc::ClientContext ctx;
    return unix_->OpenChannel(&ctx, req, resp);
  }

  const int32_t* indptr() const { return bundle_->view().kv_indptr; }
  const int32_t* lens() const { return bundle_->view().kv_lens; }
  // o (bf16) and lse (f32) of the first `rows` rows written by descriptor `d`.
  std::string OutputO(int d, int64_t rows) const {
    const ShmLayout l = d == 0 ? layout_ : ShmLayout::Of(bundle_->view(), layout_.end);
    return std::string(shm_->data() + l.o, rows * bundle_->view().shape.heads * 512 * 2);
  }
  std::string OutputLse(int d, int64_t rows) const {
    const ShmLayout l = d == 0 ? layout_ : ShmLayout::Of(bundle_->view(), layout_.end);
    return std::string(shm_->data() + l.lse, rows * bundle_->view().shape.heads * 4);
  }

  std::string dir_;
  std::unique_ptr<v1::VerifyService::Stub> unix_;
  std::unique_ptr<RandomBundle> bundle_;
  v1::VerifyRequest inline_;
  ShmLayout layout_;
  std::unique_ptr<ShmObject> shm_;
  google::protobuf::RepeatedPtrField<v1::VerifyRequest> descriptors_;
};

// Calls rung through the doorbell give the unary RPC's bytes for the same batch: both
// descriptors, both layout slots, a smaller batch than the descriptors' largest, in shadow and
// in custom mode, on odd sizes and page sizes 1 and 16.
TEST_F(DoorbellTest, CallsMatchTheUnaryRpcForTheSameBatch) {
  for (auto [seed, page, draft, prefix] :
       {std::tuple{61u, 1, 5, 37}, std::tuple{62u, 16, 7, 131}}) {
    PutBundle(seed, page, draft, prefix);
    ShmObject obj("chan" + std::to_string(seed), 1 << 16);
    v1::OpenChannelResponse g;
    ASSERT_TRUE(Open("db", obj, descriptors_, 2, &g).ok());
    EXPECT_EQ(g.max_batch(), 3u);
    EXPECT_EQ(g.layout_slots(), 2u);
    EXPECT_EQ(g.layout_slot_bytes() % 64, 0u);
    for (v1::Mode mode : {v1::MODE_SHADOW, v1::MODE_CUSTOM}) {
      ASSERT_TRUE(SetMode(mode, /*force=*/true).ok());
      for (auto [batch, slot, d] :
           {std::tuple{3, 0u, 0u}, std::tuple{2, 1u, 1u}, std::tuple{1, 1u, 0u}}) {
        v1::VerifyResponse want;
        grpc::ClientContext ctx;
        ASSERT_TRUE(unix_->Verify(&ctx, FirstRequests(inline_, batch, draft), &want).ok());
        const int64_t rows = int64_t{batch} * draft;
        std::memset(shm_->data() + layout_.o, 0xAB, 2 * layout_.end - layout_.o);
        WriteSlot(obj.data(), g, slot, batch, indptr(), lens());
        const uint32_t done = Ring(obj.data(), channel::Ring{d, slot});
        ASSERT_NE(done, kTimedOut) << "no answer";
        ASSERT_EQ(DoneCode(done), 0) << LastResponse(obj.data(), g).error_message();
        const v1::VerifyResponse got = LastResponse(obj.data(), g);
        EXPECT_EQ(got.served_path(), want.served_path());
        EXPECT_FALSE(got.has_o());
        EXPECT_EQ(OutputO(d, rows), want.o().raw_contents())
            << "seed " << seed << " batch " << batch << " descriptor " << d;
        EXPECT_EQ(OutputLse(d, rows), want.lse().raw_contents()) << "seed " << seed;
        if (batch < 3) {  // rows past the batch are not written
          EXPECT_EQ(static_cast<uint8_t>(OutputO(d, rows + 1).back()), 0xAB);
        }
      }
    }
    const v1::GetStatusResponse s = Status();
    ASSERT_EQ(s.channels_size(), 1);
    EXPECT_EQ(s.channels(0).descriptors(), 2);
    EXPECT_EQ(s.channels(0).calls(), 6);
    EXPECT_EQ(s.channels(0).failed_calls(), 0);
    v1::CloseChannelRequest close;
    close.set_name("db");
    v1::CloseChannelResponse closed;
    grpc::ClientContext ctx;
    ASSERT_TRUE(unix_->CloseChannel(&ctx, close, &closed).ok());
  }
}

// A layout slot's generation (word 1) is read from the same copy as its layout, and names the
// layout per channel and slot: 0 for none (read at every call), else a key no other channel,
// slot or generation has. Calls with a generation serve what calls without one do.
TEST_F(DoorbellTest, ASlotsGenerationNamesItsLayout) {
  PutBundle(63u, 16, 5, 77);
  ShmObject obj("chan_gen", 1 << 16);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(Open("db", obj, descriptors_, 2, &g).ok());
  absl::StatusOr<channel::DoorbellPlan> plan = channel::PlanDoorbell(descriptors_, 2, 1 << 12);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int32_t generation : {0, 1, -2}) {
    WriteSlot(obj.data(), g, 1, 3, indptr(), lens(), generation);
    v1::VerifyRequest call;
    uint32_t read = 12345;
    ASSERT_TRUE(channel::BuildDoorbellCall(descriptors_, *plan, channel::Ring{0, 1},
                                           obj.data() + g.request_offset(), &call, &read)
                    .ok());
    EXPECT_EQ(read, static_cast<uint32_t>(generation));
    const uint64_t key = channel::LayoutKey(9, 1, read);
    EXPECT_EQ(key == 0, generation == 0);
    if (generation != 0) {
      EXPECT_NE(key, channel::LayoutKey(10, 1, read));
      EXPECT_NE(key, channel::LayoutKey(9, 0, read));
      EXPECT_NE(key, channel::LayoutKey(9, 1, read + 1));
    }
    v1::VerifyResponse want;
    grpc::ClientContext ctx;
    ASSERT_TRUE(unix_->Verify(&ctx, FirstRequests(inline_, 3, 5), &want).ok());
    const uint32_t done = Ring(obj.data(), channel::Ring{0, 1});
    ASSERT_NE(done, kTimedOut) << "no answer";
    ASSERT_EQ(DoneCode(done), 0) << LastResponse(obj.data(), g).error_message();
    EXPECT_EQ(OutputO(0, 15), want.o().raw_contents()) << "generation " << generation;
  }
}

// Each bad call (an unknown descriptor or slot, a batch outside 1..max_batch, kv_indptr past the
// descriptor's kv_indices, a page id past the pool, a length past the pages) is answered in the
// done word with INVALID_ARGUMENT, its o_out is zero-filled, the response names the field, it is
// counted, and the next good call is served.
TEST_F(DoorbellTest, BadCallsGetAStatusAZeroedOutputAndTheChannelGoesOn) {
  PutBundle(71, 16, 3, 40);
  ShmObject obj("chan", 1 << 16);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(Open("db", obj, descriptors_, 0, &g).ok());
  EXPECT_EQ(g.layout_slots(), channel::kDefaultLayoutSlots);
  const int64_t rows = 3 * 3;
  std::vector<int32_t> big_indptr(indptr(), indptr() + 4);
  big_indptr[3] = 1 << 20;
  std::vector<int32_t> short_lens(lens(), lens() + 3);
  short_lens[1] += 10 * 16;  // more tokens than its pages hold
  struct Bad {
    const char* what;
    channel::Ring ring;
    int32_t batch;
    const int32_t* indptr;
    const int32_t* lens;
    const char* field;
  };
  const Bad bad[] = {
      {"unknown descriptor", {7, 0}, 3, indptr(), lens(), "doorbell: descriptor 7"},
      {"unknown slot", {0, 5}, 3, indptr(), lens(), "doorbell: layout slot 5"},
      {"batch 0", {0, 0}, 0, indptr(), lens(), "batch: 0"},
      {"batch past max", {0, 1}, 4, indptr(), lens(), "batch: 4"},
      {"indptr past kv_indices", {0, 0}, 3, big_indptr.data(), lens(), "kv_indptr[3]"},
      {"lengths past the pages", {0, 0}, 3, indptr(), short_lens.data(), "kv_indptr: request 1"},
      {"page past the pool", {0, 0}, 3, indptr(), lens(), "kv_indices[0]: page"},
  };
  auto* kv_indices = reinterpret_cast<int32_t*>(shm_->data() + layout_.kv_indices);
  const int32_t page0 = kv_indices[0];
  int failed = 0;
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    if (std::string(b.what) == "page past the pool") kv_indices[0] = 1 << 24;
    std::memset(shm_->data() + layout_.o, 0xAB, layout_.end - layout_.o);
    WriteSlot(obj.data(), g, b.ring.slot < 2 ? b.ring.slot : 0, b.batch, b.indptr, b.lens);
    const uint32_t done = Ring(obj.data(), b.ring);
    kv_indices[0] = page0;
    ASSERT_NE(done, kTimedOut) << "no answer";
    EXPECT_EQ(DoneCode(done), grpc::StatusCode::INVALID_ARGUMENT);
    const v1::VerifyResponse r = LastResponse(obj.data(), g);
    EXPECT_NE(r.error_message().find(b.field), std::string::npos) << r.error_message();
    ++failed;
    EXPECT_EQ(channel::HeaderOf(obj.data())->failed_calls.load(), static_cast<uint32_t>(failed));
    if (b.ring.descriptor == 0) {
      EXPECT_EQ(OutputO(0, rows), std::string(rows * 5 * 512 * 2, '\0')) << "o not zero-filled";
      EXPECT_EQ(OutputLse(0, rows), std::string(rows * 5 * 4, '\0')) << "lse not zero-filled";
    }
  }
  WriteSlot(obj.data(), g, 0, 3, indptr(), lens());
  const uint32_t done = Ring(obj.data(), channel::Ring{0, 0});
  ASSERT_NE(done, kTimedOut);
  EXPECT_EQ(DoneCode(done), 0) << LastResponse(obj.data(), g).error_message();
  const v1::GetStatusResponse s = Status();
  ASSERT_EQ(s.channels_size(), 1);
  EXPECT_EQ(s.channels(0).failed_calls(), failed);
  EXPECT_EQ(s.channels(0).calls(), failed + 1);
}

// Opening with bad descriptors or slots is refused naming the field, and opens nothing.
TEST_F(DoorbellTest, OpeningWithBadDescriptorsIsRefusedNamingTheField) {
  PutBundle(81, 16, 3, 20);
  ShmObject obj("chan", 1 << 16);
  struct Case {
    const char* field;
    std::function<void(v1::VerifyRequest*)> spoil;
  };
  const Case cases[] = {
      {"descriptors[1].kv_indptr",
       [](v1::VerifyRequest* d) { d->mutable_kv_indptr()->set_dtype(v1::DTYPE_I32); }},
      {"descriptors[1].q: must name a region",
       [](v1::VerifyRequest* d) { d->mutable_q()->set_raw_contents("x"); }},
      {"descriptors[1].o_out: 8 rows",
       [](v1::VerifyRequest* d) { d->mutable_o_out()->set_shape(0, 8); }},
      {"descriptors[1].tree_mask: max_batch 2",
       [](v1::VerifyRequest* d) {
         d->mutable_tree_mask()->set_shape(0, 2);
         d->mutable_q()->set_shape(0, 6);
         d->mutable_o_out()->set_shape(0, 6);
         d->mutable_lse_out()->set_shape(0, 6);
       }},
      {"descriptors[1].kv_indices: has 2 dimensions",
       [](v1::VerifyRequest* d) { d->mutable_kv_indices()->add_shape(1); }},
  };
  v1::OpenChannelResponse g;
  for (const Case& c : cases) {
    auto ds = descriptors_;
    c.spoil(&ds[1]);
    const grpc::Status st = Open("bad", obj, ds, 0, &g);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(st.error_message().find(c.field), std::string::npos) << st.error_message();
  }
  grpc::Status st = Open("bad", obj, descriptors_, 100000, &g);
  EXPECT_NE(st.error_message().find("layout_slots"), std::string::npos) << st.error_message();
  st = Open("bad", obj, google::protobuf::RepeatedPtrField<v1::VerifyRequest>(), 3, &g);
  EXPECT_NE(st.error_message().find("layout_slots: set without descriptors"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(Status().channels_size(), 0);
}

// A client killed between its ring and its answer: the call finishes, and the channel is closed
// within about a second. The client is DoorbellChild.RingsAndDies in this binary.
TEST_F(DoorbellTest, AClientKilledMidCallFreesItsChannel) {
  PutBundle(91, 16, 3, 300);
  int status = 0;
  const std::string out =
      RunChildTest("unix:" + dir_ + "/data.sock", "DoorbellChild.RingsAndDies", &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("rang and dying"), std::string::npos) << out;
  EXPECT_EQ(AwaitNoChannels(), 0) << "the dead client's channel is still open";
  // The daemon serves the next client's calls.
  ShmObject obj("after", 1 << 16);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(Open("after", obj, descriptors_, 1, &g).ok());
  WriteSlot(obj.data(), g, 0, 3, indptr(), lens());
  const uint32_t done = Ring(obj.data(), channel::Ring{0, 0});
  ASSERT_NE(done, kTimedOut);
  EXPECT_EQ(DoneCode(done), 0) << LastResponse(obj.data(), g).error_message();
}

TEST(DoorbellChild, RingsAndDies) {
  const char* target = std::getenv("VERIFYD_CHILD_TARGET");
  if (target == nullptr) GTEST_SKIP() << "the client of DoorbellTest.AClientKilledMidCall...";
  // The parent registered region "pool" with a batch-3 bundle; this child names the same layout.
  RandomBundle b(RegionBundleSpec(91, 16, 3, 300));
  v1::VerifyRequest d;
  EncodeRequest(b.view(), &d);
  std::vector<char> scratch(ShmLayout::Of(b.view()).end);
  PutInShm(b.view(), ShmLayout::Of(b.view()), scratch.data(), "pool", &d);
  d.clear_kv_indptr();
  d.clear_kv_lens();
  auto stub = v1::VerifyService::NewStub(Channel(target));
  ShmObject obj("child", 1 << 16);
  v1::OpenChannelRequest req;
  req.set_name("dying");
  req.set_key(obj.key());
  req.set_byte_size(obj.size());
  *req.add_descriptors() = d;
  v1::OpenChannelResponse g;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->OpenChannel(&ctx, req, &g).ok());
  WriteSlot(obj.data(), g, 0, 3, b.view().kv_indptr, b.view().kv_lens);
  channel::HeaderOf(obj.data())->doorbell.store(channel::RingWord({0, 0}));
  ::shm_unlink(obj.key().c_str());  // the mapping stays; no destructor runs
  std::printf("rang and dying\n");
  std::fflush(stdout);
  ::_exit(0);  // no answer awaited, nothing closed
}

TEST(DoorbellLayout, RingWordsRoundTrip) {
  for (channel::Ring r : {channel::Ring{0, 0}, channel::Ring{60, 1}, channel::Ring{4095, 255}}) {
    const uint32_t w = channel::RingWord(r);
    EXPECT_NE(w, 0u);
    EXPECT_EQ(channel::DecodeRing(w).descriptor, r.descriptor);
    EXPECT_EQ(channel::DecodeRing(w).slot, r.slot);
  }
  EXPECT_EQ(channel::DoneWord(0), channel::kDone);
  EXPECT_EQ(channel::DoneWord(3) >> 8, 3u);
}

}  // namespace
}  // namespace verifyd::testing
