// Ceilings on what clients can take: idle connections cannot hold back a /metrics scrape, and
// idle streams do not get a daemon thread each.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

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

class SmallThreadCeilingTest : public LimitsTest {
 protected:
  DaemonOptions Options() override {
    DaemonOptions o = LimitsTest::Options();
    o.grpc_max_threads = 4;
    return o;
  }
};

TEST_F(SmallThreadCeilingTest, ACallBeyondTheCeilingIsRefusedAtOnce) {
  struct Open {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < 8; ++i) {
    auto o = std::make_unique<Open>();
    o->stream = verify_->VerifyStream(&o->ctx);
    open.push_back(std::move(o));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::VerifyResponse resp;
  const auto t0 = Clock::now();
  const grpc::Status st = verify_->Verify(&ctx, testing::SmallRequest(2), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
  for (auto& o : open) o->ctx.TryCancel();
  for (auto& o : open) (void)o->stream->Finish();
}

TEST_F(LimitsTest, IdleConnectionsDoNotHoldBackAScrape) {
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(IdleConnection(daemon_->metrics_port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // all accepted and waiting
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

TEST_F(LimitsTest, IdleStreamsDoNotGetAThreadEach) {
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
  struct Open {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < kStreams; ++i) {
    auto o = std::make_unique<Open>();
    o->stream = stubs[i % stubs.size()]->VerifyStream(&o->ctx);
    open.push_back(std::move(o));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int during = Threads();
  std::printf("threads: %d before, %d with %d idle streams\n", before, during, kStreams);
  EXPECT_LT(during - before, 300) << before << " threads before, " << during << " with "
                                  << kStreams << " idle streams";
  // The admin API and /metrics still answer while the data plane is full.
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_NE(testing::Scrape(daemon_->metrics_port()).find("verifyd_build_info"),
            std::string::npos);
  for (auto& o : open) o->ctx.TryCancel();
  for (auto& o : open) (void)o->stream->Finish();
  open.clear();
  // Served again once the streams are gone.
  bool served = false;
  for (int i = 0; i < 50 && !served; ++i) {
    v1::VerifyResponse resp;
    served = Verify(testing::SmallRequest(1), &resp).ok();
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(served);
}

}  // namespace
}  // namespace verifyd
