// Call channels end to end over a Unix socket: calls through a channel give the unary RPC's
// bytes, inline or naming shm regions; a bad request, a bad frame or an answer too large for the
// area gets a clear error naming the field and the channel goes on; opening is refused with
// errors naming the field; closing wakes a waiting client; a client that shrinks its object does
// not take the daemon down; channels are refused over TCP; the channel count is a metric.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/channel/channel_client.h"
#include "src/channel/channel_layout.h"
#include "src/channel/futex_word.h"
#include "tests/service/daemon_fixture.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd::testing {
namespace {

using channel::ChannelClient;
using channel::ChannelClientOptions;

class ChannelTest : public DaemonTest {
 protected:
  void Start(int max_channels = 4) {
    dir_ = TestDir("channel");
    DaemonOptions o = TestOptions(dir_);
    o.regions.max_total_bytes = uint64_t{1} << 30;
    o.handler.oracle_sample_rate = 0;
    o.channels.max_channels = max_channels;
    StartDaemon(std::move(o));
    unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
  }
  absl::StatusOr<std::unique_ptr<ChannelClient>> OpenClient(
      const std::string& name, uint64_t bytes = 8 << 20, v1::VerifyService::Stub* via = nullptr) {
    ChannelClientOptions o;
    o.name = name;
    o.byte_size = bytes;
    o.client = "test";
    return ChannelClient::Open(
        *(via ? via : unix_.get()), [] { return std::make_unique<grpc::ClientContext>(); }, o);
  }
  grpc::Status OpenRaw(const std::string& name, const std::string& key, uint64_t bytes,
                       v1::OpenChannelResponse* resp) {
    v1::OpenChannelRequest req;
    req.set_name(name);
    req.set_key(key);
    req.set_byte_size(bytes);
    grpc::ClientContext ctx;
    return unix_->OpenChannel(&ctx, req, resp);
  }
  grpc::Status Close(const std::string& name, const std::string& client = "") {
    v1::CloseChannelRequest req;
    req.set_name(name);
    req.set_client(client);
    v1::CloseChannelResponse resp;
    grpc::ClientContext ctx;
    return unix_->CloseChannel(&ctx, req, &resp);
  }
  grpc::Status VerifyUnix(const v1::VerifyRequest& req, v1::VerifyResponse* resp) {
    grpc::ClientContext ctx;
    return unix_->Verify(&ctx, req, resp);
  }
  grpc::Status RegisterShm(const std::string& name, const ShmObject& shm) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name);
    req.set_key(shm.key());
    req.set_byte_size(shm.size());
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return unix_->RegisterShmRegion(&ctx, req, &resp);
  }

  std::string dir_;
  std::unique_ptr<v1::VerifyService::Stub> unix_;
};

// One call through a channel the test drives itself, byte by byte as the layout says: what a
// client in another language does.
v1::VerifyResponse RawCall(char* base, const v1::OpenChannelResponse& g, const std::string& bytes,
                           uint32_t request_bytes, uint32_t seq) {
  channel::Header* h = channel::HeaderOf(base);
  std::memcpy(base + g.request_offset(), bytes.data(),
              std::min<size_t>(bytes.size(), g.capacity()));
  h->request_bytes.store(request_bytes);
  h->request_seq.store(seq, std::memory_order_release);
  channel::FutexWake(&h->request_seq);
  const uint32_t got =
      channel::AwaitChange(&h->response_seq, seq - 1, absl::Milliseconds(1), absl::Milliseconds(50),
                           nullptr, absl::Now() + absl::Seconds(30));
  v1::VerifyResponse resp;
  EXPECT_EQ(got, seq) << "no answer";
  if (got == seq) {
    EXPECT_TRUE(resp.ParseFromArray(base + g.response_offset(),
                                    static_cast<int>(h->response_bytes.load())));
  }
  return resp;
}

// Inline and region calls through a channel serve the unary RPC's bytes: the reference in shadow
// mode, the custom path in custom mode, on odd sizes and page sizes 1 and 16.
TEST_F(ChannelTest, CallsMatchTheUnaryRpcBitForBit) {
  Start();
  ShmObject shm("pool", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  auto chan = OpenClient("c0");
  ASSERT_TRUE(chan.ok()) << chan.status();
  for (v1::Mode mode : {v1::MODE_SHADOW, v1::MODE_CUSTOM}) {
    if (mode == v1::MODE_CUSTOM) {
      ASSERT_TRUE(SetMode(mode, /*force=*/true).ok());
    }
    for (auto [seed, page, draft, prefix] :
         {std::tuple{21u, 1, 5, 37}, std::tuple{22u, 16, 7, 131}, std::tuple{23u, 16, 1, 0}}) {
      RandomBundle b(RegionBundleSpec(seed, page, draft, prefix));
      v1::VerifyRequest req;
      EncodeRequest(b.view(), &req);
      req.set_want_lse(true);
      req.set_request_id("r" + std::to_string(seed));
      v1::VerifyResponse want, got;
      ASSERT_TRUE(VerifyUnix(req, &want).ok());
      ASSERT_TRUE((*chan)->Call(req, &got).ok());
      ASSERT_EQ(got.error_code(), 0) << got.error_message();
      EXPECT_EQ(got.request_id(), req.request_id());
      EXPECT_EQ(got.served_path(), want.served_path());
      EXPECT_EQ(got.o().raw_contents(), want.o().raw_contents()) << "seed " << seed;
      EXPECT_EQ(got.lse().raw_contents(), want.lse().raw_contents()) << "seed " << seed;
      EXPECT_GT(got.timing().total_seconds(), 0);
      EXPECT_GT(got.timing().served_device_seconds(), 0);
      EXPECT_LE(got.timing().served_device_seconds(), got.timing().total_seconds());

      // Every tensor in the region, o and lse written there.
      const ShmLayout l = ShmLayout::Of(b.view());
      std::memset(shm.data() + l.o, 0xAB, l.end - l.o);
      PutInShm(b.view(), l, shm.data(), "pool", &req);
      v1::VerifyResponse in_place;
      ASSERT_TRUE((*chan)->Call(req, &in_place).ok());
      ASSERT_EQ(in_place.error_code(), 0) << in_place.error_message();
      EXPECT_FALSE(in_place.has_o());
      EXPECT_EQ(std::memcmp(shm.data() + l.o, want.o().raw_contents().data(),
                            want.o().raw_contents().size()),
                0)
          << "seed " << seed;
    }
  }
}

// Channels on several threads at once, each its own: every answer is its own call's.
TEST_F(ChannelTest, ConcurrentChannelsEachGetTheirOwnAnswers) {
  Start();
  constexpr int kThreads = 4, kCalls = 12;
  std::vector<v1::VerifyRequest> reqs(kThreads);
  std::vector<v1::VerifyResponse> want(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    reqs[i] = SmallRequest(40 + i, 2 + i, 17 * i + 3, i % 2 ? 1 : 16);
    ASSERT_TRUE(VerifyUnix(reqs[i], &want[i]).ok());
  }
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto chan = OpenClient("t" + std::to_string(i));
      ASSERT_TRUE(chan.ok()) << chan.status();
      for (int n = 0; n < kCalls; ++n) {
        v1::VerifyResponse got;
        ASSERT_TRUE((*chan)->Call(reqs[i], &got).ok());
        if (got.error_code() == 0 && got.o().raw_contents() == want[i].o().raw_contents()) {
          good.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), kThreads * kCalls);
}

// A request verifyd refuses, bytes that are no request and a size past the area each get an
// answer naming the field; the channel serves the next call.
TEST_F(ChannelTest, BadCallsAreAnsweredNamingTheFieldAndTheChannelGoesOn) {
  Start();
  ShmObject obj("raw", 1 << 20);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenRaw("raw", obj.key(), obj.size(), &g).ok());
  EXPECT_EQ(g.request_offset(), channel::kHeaderBytes);
  EXPECT_EQ(g.capacity(), (obj.size() - channel::kHeaderBytes) / 2);
  const channel::Header* h = channel::HeaderOf(obj.data());
  EXPECT_EQ(h->magic, channel::kMagic);
  EXPECT_EQ(h->state.load(), channel::kStateOpen);

  v1::VerifyRequest bad = SmallRequest(5);
  bad.mutable_kv_lens()->set_raw_contents(std::string(8, '\x7f'));
  std::string bytes = bad.SerializeAsString();
  uint32_t seq = 0;
  v1::VerifyResponse r = RawCall(obj.data(), g, bytes, bytes.size(), ++seq);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.error_message().find("kv_lens"), std::string::npos) << r.error_message();

  r = RawCall(obj.data(), g, "\xff\xff\xff\xff garbage", 14, ++seq);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.error_message().find("could not be parsed"), std::string::npos) << r.error_message();

  for (uint32_t size : {g.capacity() + 1, 0u, 0xffffffffu}) {
    r = RawCall(obj.data(), g, "", size, ++seq);
    EXPECT_EQ(r.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(r.error_message().find("request_bytes"), std::string::npos) << r.error_message();
  }

  // An answer larger than the area (inputs in a region, o inline): refused naming o_out.
  RandomBundle big(RegionBundleSpec(9, 16, 64, 64));
  ShmObject pool("bigpool", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", pool).ok());
  v1::VerifyRequest large;
  EncodeRequest(big.view(), &large);
  PutInShm(big.view(), ShmLayout::Of(big.view()), pool.data(), "pool", &large);
  large.clear_o_out();
  large.clear_lse_out();
  bytes = large.SerializeAsString();
  ASSERT_LE(bytes.size(), g.capacity());
  ASSERT_GT(big.view().o_elems() * 2, g.capacity());
  r = RawCall(obj.data(), g, bytes, bytes.size(), ++seq);
  EXPECT_EQ(r.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.error_message().find("o_out"), std::string::npos) << r.error_message();

  const v1::VerifyRequest good = SmallRequest(6, 1, 0, 16);
  v1::VerifyResponse want;
  ASSERT_TRUE(VerifyUnix(good, &want).ok());
  bytes = good.SerializeAsString();
  ASSERT_LE(bytes.size(), g.capacity());
  r = RawCall(obj.data(), g, bytes, bytes.size(), ++seq);
  EXPECT_EQ(r.error_code(), 0) << r.error_message();
  EXPECT_EQ(r.o().raw_contents(), want.o().raw_contents());

  // The client side refuses a request larger than the area before writing it.
  auto small = OpenClient("small", channel::kMinBytes);
  ASSERT_TRUE(small.ok()) << small.status();
  v1::VerifyResponse unused;
  const absl::Status st = (*small)->Call(SmallRequest(5), &unused);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  ASSERT_TRUE(Close("raw").ok());
  EXPECT_EQ(h->state.load(), channel::kStateClosed);
}

TEST_F(ChannelTest, OpeningIsRefusedNamingTheField) {
  Start(/*max_channels=*/2);
  ShmObject obj("open", 64 << 10);
  v1::OpenChannelResponse g;
  auto expect = [&](grpc::Status st, grpc::StatusCode code, const std::string& text) {
    EXPECT_EQ(st.error_code(), code) << st.error_message();
    EXPECT_NE(st.error_message().find(text), std::string::npos) << st.error_message();
  };
  expect(OpenRaw("", obj.key(), obj.size(), &g), grpc::StatusCode::INVALID_ARGUMENT, "name");
  expect(OpenRaw("a", obj.key(), 4096, &g), grpc::StatusCode::INVALID_ARGUMENT, "byte_size");
  expect(OpenRaw("a", obj.key(), obj.size() + 4096, &g), grpc::StatusCode::INVALID_ARGUMENT,
         "byte_size");
  expect(OpenRaw("a", "/vdtest-no-such-object", obj.size(), &g), grpc::StatusCode::NOT_FOUND,
         "key");
  expect(OpenRaw("a", "no-slash", obj.size(), &g), grpc::StatusCode::INVALID_ARGUMENT, "key");
  ASSERT_TRUE(OpenRaw("a", obj.key(), obj.size(), &g).ok());
  expect(OpenRaw("a", obj.key(), obj.size(), &g), grpc::StatusCode::ALREADY_EXISTS, "name");
  ASSERT_TRUE(OpenRaw("b", obj.key(), obj.size(), &g).ok());
  expect(OpenRaw("c", obj.key(), obj.size(), &g), grpc::StatusCode::RESOURCE_EXHAUSTED,
         "--max_channels");
  expect(Close("nope"), grpc::StatusCode::NOT_FOUND, "name");
  // Over TCP nobody is known: refused like regions.
  v1::OpenChannelRequest req;
  req.set_name("tcp");
  req.set_key(obj.key());
  req.set_byte_size(obj.size());
  grpc::ClientContext ctx;
  expect(verify_->OpenChannel(&ctx, req, &g), grpc::StatusCode::PERMISSION_DENIED,
         "Unix sockets only");
  // The daemon still serves.
  v1::VerifyResponse resp;
  EXPECT_TRUE(Verify(SmallRequest(3), &resp).ok());
}

// Closing a channel (here all of one client's) wakes a client waiting on it, which then sees
// UNAVAILABLE; the open channels are a metric.
TEST_F(ChannelTest, CloseIsSeenByTheClientAndCounted) {
  Start();
  auto a = OpenClient("a");
  auto b = OpenClient("b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_channels 2"), std::string::npos);
  v1::VerifyResponse resp;
  ASSERT_TRUE((*a)->Call(SmallRequest(1), &resp).ok());
  const v1::GetStatusResponse status = Status();
  ASSERT_EQ(status.channels_size(), 2);
  EXPECT_EQ(status.channels(0).name(), "a");
  EXPECT_EQ(status.channels(0).calls(), 1);
  EXPECT_EQ(status.channels(0).client(), "test");
  EXPECT_EQ(status.channels(0).key(), (*a)->key());
  EXPECT_EQ(status.channels(0).capacity(), (*a)->capacity());
  EXPECT_EQ(status.channels(1).calls(), 0);
  ASSERT_TRUE(Close("", "test").ok());
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_channels 0"), std::string::npos);
  const absl::Status st = (*a)->Call(SmallRequest(1), &resp);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("closed"), std::string::npos) << st;
}

// verifyd reads a channel call's q and pool where the client wrote them; the other path and the
// comparison run after the answer, when the client may already write its next call there. They
// read verifyd's own copy: garbage written over the whole request area right after each answer
// changes nothing, and every comparison stays clean.
TEST_F(ChannelTest, ShadowIsCleanWhenTheClientRewritesTheAreaAfterTheAnswer) {
  Start();
  ASSERT_EQ(Status().mode(), v1::MODE_SHADOW);
  ShmObject obj("rewrite", 8 << 20);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenRaw("w", obj.key(), obj.size(), &g).ok());
  constexpr int kCalls = 6;
  for (int i = 0; i < kCalls; ++i) {
    RandomBundle b(RegionBundleSpec(200 + i, i % 2 ? 1 : 16, 6, 300));
    v1::VerifyRequest req;
    EncodeRequest(b.view(), &req);
    v1::VerifyResponse want;
    ASSERT_TRUE(VerifyUnix(req, &want).ok());
    const std::string bytes = req.SerializeAsString();
    ASSERT_LE(bytes.size(), g.capacity());
    const v1::VerifyResponse got = RawCall(obj.data(), g, bytes, bytes.size(), i + 1);
    ASSERT_EQ(got.error_code(), 0) << got.error_message();
    EXPECT_EQ(got.o().raw_contents(), want.o().raw_contents());
    std::memset(obj.data() + g.request_offset(), 0xFF, g.capacity());  // NaN everywhere
  }
  const v1::Counters c = WaitForComparisons(2 * kCalls);
  EXPECT_EQ(c.comparisons_match(), 2 * kCalls);
  EXPECT_EQ(c.comparisons_breach(), 0);
  EXPECT_EQ(c.comparisons_error(), 0);
}

// A client that shrinks its object under the mapping: verifyd reads zeros, not a fault; the
// channel stops serving and the daemon goes on.
TEST_F(ChannelTest, AShrunkObjectStopsItsChannelNotTheDaemon) {
  Start();
  ShmObject obj("shrink", 1 << 20);
  v1::OpenChannelResponse g;
  ASSERT_TRUE(OpenRaw("s", obj.key(), obj.size(), &g).ok());
  channel::Header* h = channel::HeaderOf(obj.data());
  const std::string bytes = SmallRequest(2).SerializeAsString();
  ASSERT_LE(bytes.size(), g.capacity());
  std::memcpy(obj.data() + g.request_offset(), bytes.data(), bytes.size());
  // The object keeps its header page and loses the areas; then the call is rung.
  const int fd = shm_open(obj.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, channel::kHeaderBytes), 0);
  close(fd);
  h->request_bytes.store(bytes.size());
  h->request_seq.store(1, std::memory_order_release);
  channel::FutexWake(&h->request_seq);
  const uint32_t got =
      channel::AwaitChange(&h->response_seq, 0, absl::ZeroDuration(), absl::Milliseconds(50),
                           nullptr, absl::Now() + absl::Milliseconds(500));
  EXPECT_EQ(got, 0u) << "verifyd answered a call it could not read";
  v1::VerifyResponse resp;
  EXPECT_TRUE(VerifyUnix(SmallRequest(3), &resp).ok());
  auto other = OpenClient("other");
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE((*other)->Call(SmallRequest(3), &resp).ok());
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
  const v1::GetStatusResponse status = Status();
  ASSERT_EQ(status.channels_size(), 2);
  EXPECT_EQ(status.channels(1).name(), "s");
  EXPECT_TRUE(status.channels(1).stopped());
  EXPECT_FALSE(status.channels(0).stopped());
  EXPECT_TRUE(Close("s").ok());
}

// A client process that exits without closing its channel (a crash): verifyd watches the
// process that opened it and closes the channel within about a second, so dead clients do not
// use up --max_channels. The client is ChannelChild.OpensAChannelAndExits in this binary.
TEST_F(ChannelTest, AClientThatExitsWithoutClosingHasItsChannelClosed) {
  Start();
  int status = 0;
  const std::string out =
      RunChildTest("unix:" + dir_ + "/data.sock", "ChannelChild.OpensAChannelAndExits", &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("opened and exiting"), std::string::npos) << out;
  EXPECT_EQ(AwaitNoChannels(), 0) << "the dead client's channel is still open";
  // The dead client left no object behind: its name went when the channel opened.
  const size_t at = out.find("object /verifyd-ch-");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string key = out.substr(at + 7, out.find_first_of(" \n", at + 7) - (at + 7));
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + key)) << key << " is left in /dev/shm";
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_channels 0"), std::string::npos);
  // A live client's channel is watched but stays.
  auto live = OpenClient("live");
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + (*live)->key())) << "named while open";
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  const v1::GetStatusResponse s = Status();
  ASSERT_EQ(s.channels_size(), 1);
  EXPECT_EQ(s.channels(0).client_pid(), ::getpid());
}

// A process that died without unlinking its channel's object leaves it in /dev/shm, and a later
// process may get the same pid: that stale name must not keep this process from opening a
// channel. The stale objects here carry every name a pid-and-counter scheme would give.
TEST_F(ChannelTest, AStaleObjectOfAnEarlierProcessWithThisPidDoesNotBlockOpening) {
  Start();
  std::vector<std::string> stale;
  for (int i = 0; i < 16; ++i) {
    stale.push_back(absl::StrCat("/verifyd-ch-", ::getpid(), "-", i));
    const int fd = ::shm_open(stale.back().c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << stale.back() << ": " << std::strerror(errno);
    ::close(fd);
  }
  for (const char* name : {"first", "second"}) {
    auto c = OpenClient(name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    RandomBundle b(RegionBundleSpec(7, 16, 3, 40));
    v1::VerifyRequest req;
    EncodeRequest(b.view(), &req);
    v1::VerifyResponse resp;
    ASSERT_TRUE((*c)->Call(req, &resp).ok()) << name;
    EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
    EXPECT_TRUE(resp.has_o()) << name;
  }
  for (const std::string& key : stale) ::shm_unlink(key.c_str());
}

TEST(ChannelChild, OpensAChannelAndExits) {
  const char* target = std::getenv("VERIFYD_CHILD_TARGET");
  if (target == nullptr) {
    GTEST_SKIP() << "the client of ChannelTest.AClientThatExitsWithoutClosingHasItsChannelClosed";
  }
  auto stub = v1::VerifyService::NewStub(Channel(target));
  ChannelClientOptions o;
  o.name = "orphan";
  o.byte_size = channel::kMinBytes;
  auto c = ChannelClient::Open(
      *stub, [] { return std::make_unique<grpc::ClientContext>(); }, o);
  ASSERT_TRUE(c.ok()) << c.status();
  // Its object's name went when the channel opened: nothing is left behind in /dev/shm.
  std::printf("opened and exiting, object %s\n", (*c)->key().c_str());
  std::fflush(stdout);
  ::_exit(0);  // no destructor runs: the channel is never closed
}

TEST(ChannelLayout, GeometryAndFrames) {
  EXPECT_EQ(channel::GeometryFor(channel::kMinBytes - 1, 1 << 30).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto g = channel::GeometryFor(channel::kMinBytes + 100, 1 << 30);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->capacity % channel::kAreaAlign, 0u);
  EXPECT_EQ(g->capacity, 4096u);
  EXPECT_EQ(g->response_offset, g->request_offset + g->capacity);
  g = channel::GeometryFor(uint64_t{1} << 20, 8192);  // capped
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->capacity, 8192u);
  EXPECT_LE(g->response_offset + g->capacity, uint64_t{1} << 20);

  std::vector<char> mem(channel::kHeaderBytes + 2 * 8192);
  channel::InitHeader(mem.data(), *g);
  EXPECT_FALSE(channel::RequestIn(mem.data(), *g).ok());  // nothing written: 0 bytes
  channel::HeaderOf(mem.data())->request_bytes.store(8192);
  std::memset(mem.data() + g->request_offset, 'x', 8192);
  absl::StatusOr<absl::string_view> in = channel::RequestIn(mem.data(), *g);
  ASSERT_TRUE(in.ok());
  EXPECT_EQ(in->data(), mem.data() + g->request_offset);  // where the client left it
  EXPECT_EQ(*in, std::string(8192, 'x'));
  channel::HeaderOf(mem.data())->request_bytes.store(8193);
  const absl::Status st = channel::RequestIn(mem.data(), *g).status();
  EXPECT_NE(st.message().find("request_bytes"), std::string::npos) << st;
  std::memcpy(channel::ResponseArea(mem.data(), *g), "answer", 6);
  channel::PublishResponse(mem.data(), 6, 7);
  EXPECT_EQ(channel::HeaderOf(mem.data())->response_seq.load(), 7u);
  EXPECT_EQ(channel::HeaderOf(mem.data())->response_bytes.load(), 6u);
  EXPECT_EQ(std::string(mem.data() + g->response_offset, 6), "answer");
}

// The channel thread's spin after a call: twice the last gap when calls came within the cap, so
// a caller that comes back as fast is caught without a wake-up; just the floor after a longer
// gap, so a slow caller costs no core.
TEST(ChannelSpin, TwiceTheLastGapWithinTheCapElseTheFloor) {
  using absl::Microseconds;
  const absl::Duration floor = Microseconds(50), cap = Microseconds(1000);
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(100), floor, cap), Microseconds(200));
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(10), floor, cap), floor);
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(700), floor, cap), cap);
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(1000), floor, cap), cap);
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(1001), floor, cap), floor);
  EXPECT_EQ(channel::AdaptiveSpin(absl::InfiniteDuration(), floor, cap), floor);  // first call
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(10), floor, Microseconds(20)), Microseconds(20));
  EXPECT_EQ(channel::AdaptiveSpin(Microseconds(10), floor, absl::ZeroDuration()),
            absl::ZeroDuration());  // --channel_spin_us=0: never spins
}

}  // namespace
}  // namespace verifyd::testing
