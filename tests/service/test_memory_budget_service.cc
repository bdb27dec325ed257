// The memory budget over real gRPC: a request is admitted only when its bytes fit next to the
// calls in flight; otherwise it is refused at once with RESOURCE_EXHAUSTED naming the limit, and
// counted.

#include <chrono>
#include <future>
#include <thread>

#include "src/transport/memory_budget.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

using testing::DaemonTest;

// A request the CPU engine takes a while over, and its size on the wire.
v1::VerifyRequest SlowRequest() {
  RandomBundleSpec spec;
  spec.batch = 1;
  spec.draft = 8;
  spec.heads = 8;
  spec.prefix = 8192;
  spec.page_size = 64;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

class MemoryBudgetTest : public DaemonTest {};

TEST_F(MemoryBudgetTest, ARequestThatDoesNotFitNextToOneInFlightIsRefusedAtOnce) {
  const v1::VerifyRequest slow = SlowRequest();
  const int64_t slow_bytes = static_cast<int64_t>(slow.ByteSizeLong());
  DaemonOptions o = testing::TestOptions(testing::TestDir("budget"));
  o.max_inflight_bytes = slow_bytes + slow_bytes / 2;
  StartDaemon(o);

  // Larger than the whole budget: refused whatever is in flight.
  v1::VerifyRequest huge = slow;
  huge.mutable_kv_pool()->mutable_raw_contents()->append(slow_bytes, '\0');
  v1::VerifyResponse resp;
  grpc::Status st = Verify(huge, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("exceeds the memory budget"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--max_inflight_mb"), std::string::npos);

  auto first = std::async(std::launch::async, [&] {
    v1::VerifyResponse r;
    return Verify(slow, &r);
  });
  // The handler counts a call once the budget admitted it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (daemon_->handler().counters().requests() == 0 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(daemon_->handler().counters().requests(), 1);
  const auto t0 = std::chrono::steady_clock::now();
  st = Verify(slow, &resp);
  const double refused_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("does not fit the memory budget now"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--max_inflight_mb"), std::string::npos);
  EXPECT_EQ(first.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the first call ended before the second was refused; the test proves nothing";
  ASSERT_TRUE(first.get().ok());
  EXPECT_LT(refused_s, 5.0);
  // Once the first call is done its bytes are back.
  st = Verify(slow, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  const std::string metrics = testing::Scrape(daemon_->metrics_port());
  EXPECT_NE(metrics.find("verifyd_requests_total{code=\"RESOURCE_EXHAUSTED\",path=\"none\"} 2"),
            std::string::npos);
}

}  // namespace
}  // namespace verifyd
