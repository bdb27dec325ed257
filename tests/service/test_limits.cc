// Ceilings on what clients can take: idle connections cannot hold back a /metrics scrape, idle
// streams cannot take the threads that unary calls need, and a stream that sends nothing is
// cancelled after the idle timeout.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;
using Clock = std::chrono::steady_clock;

int Threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Connections waiting in the accept queue of the listener on `port` (its rx_queue in
// /proc/net/tcp or tcp6); -1 when no listener is found.
int AcceptBacklog(int port) {
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream tcp(table);
    std::string line;
    std::getline(tcp, line);  // header
    while (std::getline(tcp, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues;
      f >> slot >> local >> remote >> state >> queues;
      const size_t colon = local.rfind(':'), sep = queues.find(':');
      if (colon == std::string::npos || sep == std::string::npos || state != "0A") continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      return std::stoi(queues.substr(sep + 1), nullptr, 16);
    }
  }
  return -1;
}

// A TCP connection to 127.0.0.1:port that never sends anything.
int IdleConnection(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return s;
}

class LimitsTest : public DaemonTest {
 protected:
  void SetUp() override { StartDaemon(Options()); }
  virtual DaemonOptions Options() { return testing::TestOptions(testing::TestDir("limits")); }
};

using Stream = grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>;
struct OpenStream {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream;
};

// The status of a new stream that sends one call and closes.
grpc::Status OneCallOnANewStream(v1::VerifyService::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto s = stub->VerifyStream(&ctx);
  s->Write(testing::SmallRequest(1));
  s->WritesDone();
  v1::VerifyResponse resp;
  while (s->Read(&resp)) {
  }
  return s->Finish();
}

// Whether the daemon refuses one more stream (its ceiling is reached): the stream's first call
// ends with RESOURCE_EXHAUSTED naming --grpc_max_streams, instead of an answer.
bool StreamRefused(v1::VerifyService::Stub* stub) {
  const grpc::Status st = OneCallOnANewStream(stub);
  return st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
         st.error_message().find("--grpc_max_streams") != std::string::npos;
}

// Waits (up to 20 s) until the daemon refuses a further stream: every stream opened before is
// then held open by the daemon.
bool WaitUntilStreamsAreFull(v1::VerifyService::Stub* stub) {
  for (int i = 0; i < 200; ++i) {
    if (StreamRefused(stub)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

class SmallThreadCeilingTest : public LimitsTest {
 protected:
  DaemonOptions Options() override {
    DaemonOptions o = LimitsTest::Options();
    o.grpc_max_threads = 4;
    o.streams.max_streams = 2;
    return o;
  }
};

TEST_F(SmallThreadCeilingTest, StreamsBeyondTheirCeilingAreRefusedAndUnaryCallsAreServed) {
  std::vector<std::unique_ptr<OpenStream>> open;
  for (int i = 0; i < 8; ++i) {
    auto o = std::make_unique<OpenStream>();
    o->stream = verify_->VerifyStream(&o->ctx);
    open.push_back(std::move(o));
  }
  ASSERT_TRUE(WaitUntilStreamsAreFull(verify_.get()));
  // Two threads hold idle streams; the other two serve unary calls.
  for (int i = 0; i < 5; ++i) {
    v1::VerifyResponse resp;
    const grpc::Status st = Verify(testing::SmallRequest(2), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  for (auto& o : open) o->ctx.TryCancel();
  for (auto& o : open) (void)o->stream->Finish();
}

class PerPeerStreamsTest : public LimitsTest {
 protected:
  DaemonOptions Options() override {
    DaemonOptions o = LimitsTest::Options();
    o.streams.max_streams = 8;
    o.streams.max_streams_per_peer = 3;
    return o;
  }
};

// One peer (the TCP host here) holds at most its share of the streams, however many it opens;
// another peer (the Unix socket's uid) still gets one and is answered on it.
TEST_F(PerPeerStreamsTest, OnePeerHoldsAtMostItsShareAndAnotherStillGetsAStream) {
  std::vector<std::unique_ptr<OpenStream>> open;
  for (int i = 0; i < 10; ++i) {
    auto o = std::make_unique<OpenStream>();
    o->stream = verify_->VerifyStream(&o->ctx);
    open.push_back(std::move(o));
  }
  ASSERT_TRUE(WaitUntilStreamsAreFull(verify_.get()));
  const grpc::Status st = OneCallOnANewStream(verify_.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("ipv4:127.0.0.1 has 3 streams open, the most "
                                    "--grpc_max_streams_per_peer=3 allows"),
            std::string::npos)
      << st.error_message();
  auto other = v1::VerifyService::NewStub(testing::Channel(daemon_->listen_addresses()[1]));
  v1::VerifyResponse resp;
  OpenStream mine;
  mine.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  mine.stream = other->VerifyStream(&mine.ctx);
  ASSERT_TRUE(mine.stream->Write(testing::SmallRequest(2)));
  ASSERT_TRUE(mine.stream->Read(&resp));
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
  mine.stream->WritesDone();
  EXPECT_TRUE(mine.stream->Finish().ok());
  for (auto& o : open) o->ctx.TryCancel();
  for (auto& o : open) (void)o->stream->Finish();
  const std::string m = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(m.find("verifyd_tenancy_refusals_total{reason=\"peer_share\",resource=\"stream\"}"),
            std::string::npos);
}

class IdleTimeoutTest : public LimitsTest {
 protected:
  DaemonOptions Options() override {
    DaemonOptions o = LimitsTest::Options();
    o.streams.idle_timeout = absl::Milliseconds(300);
    return o;
  }
};

TEST_F(IdleTimeoutTest, AStreamThatSendsNothingIsCancelledAndOneThatSendsIsNot) {
  OpenStream idle;
  idle.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  idle.stream = verify_->VerifyStream(&idle.ctx);
  OpenStream busy;
  busy.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  busy.stream = verify_->VerifyStream(&busy.ctx);
  const auto t0 = Clock::now();
  // The busy stream sends every 100 ms for a second: each call is answered.
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(busy.stream->Write(testing::SmallRequest(1)));
    v1::VerifyResponse resp;
    ASSERT_TRUE(busy.stream->Read(&resp));
    EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  v1::VerifyResponse resp;
  EXPECT_FALSE(idle.stream->Read(&resp));  // ends when the daemon cancels it
  const grpc::Status st = idle.stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 15.0);
  busy.stream->WritesDone();
  EXPECT_TRUE(busy.stream->Finish().ok());
}

TEST_F(LimitsTest, IdleConnectionsDoNotHoldBackAScrape) {
  std::vector<int> idle;
  const int port = daemon_->metrics_port();
  for (int i = 0; i < 64; ++i) idle.push_back(IdleConnection(port));
  // The scrapes below count only once the server has taken every idle connection off its accept
  // queue (it may hold them or close them; either way none is left waiting).
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (AcceptBacklog(port) != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(AcceptBacklog(port), 0) << "idle connections still wait in the metrics accept queue";
  for (int round = 0; round < 3; ++round) {
    const auto t0 = Clock::now();
    const std::string body = testing::Scrape(daemon_->metrics_port());
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_NE(body.find("verifyd_build_info"), std::string::npos);
    std::printf("scrape %d with 64 idle connections: %.3f s\n", round, s);
    EXPECT_LT(s, 1.0) << "scrape " << round << " with 64 idle connections";
  }
  for (int s : idle) ::close(s);
}

TEST_F(LimitsTest, AThousandIdleStreamsFromOnePeerDoNotLockOtherClientsOut) {
  const int before = Threads();
  constexpr int kStreams = 1000;
  // Several connections: one carries at most --grpc_max_concurrent_streams.
  std::vector<std::unique_ptr<v1::VerifyService::Stub>> stubs;
  for (int i = 0; i < 8; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("verifyd.test.channel", i);  // distinct channels, not one shared subchannel
    stubs.push_back(v1::VerifyService::NewStub(
        grpc::CreateCustomChannel(tcp_, grpc::InsecureChannelCredentials(), args)));
  }
  std::vector<std::unique_ptr<OpenStream>> open;
  for (int i = 0; i < kStreams; ++i) {
    auto o = std::make_unique<OpenStream>();
    o->stream = stubs[i % stubs.size()]->VerifyStream(&o->ctx);
    open.push_back(std::move(o));
  }
  ASSERT_TRUE(WaitUntilStreamsAreFull(verify_.get()));
  const int during = Threads();
  std::printf("threads: %d before, %d with %d idle streams\n", before, during, kStreams);
  EXPECT_LT(during - before, 300) << before << " threads before, " << during << " with " << kStreams
                                  << " idle streams";
  // A new client's calls are served while the streams stay open, and so are the admin API and
  // /metrics.
  auto fresh =
      v1::VerifyService::NewStub(grpc::CreateChannel(tcp_, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::VerifyResponse resp;
    const grpc::Status st = fresh->Verify(&ctx, testing::SmallRequest(1), &resp);
    EXPECT_TRUE(st.ok()) << "call " << i << ": " << st.error_message();
  }
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_NE(testing::Scrape(daemon_->metrics_port()).find("verifyd_build_info"), std::string::npos);
  for (auto& o : open) o->ctx.TryCancel();
  for (auto& o : open) (void)o->stream->Finish();
}

}  // namespace
}  // namespace verifyd
