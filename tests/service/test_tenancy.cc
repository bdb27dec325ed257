// Tenancy end to end: what one peer on the data socket registers or opens, a peer of another uid
// can neither read nor write through a call, list, unregister nor close, by name or by client
// name; each refusal is PERMISSION_DENIED naming the field and the region or channel, counted and
// audited, and the owner goes on being served. What a process registered or opened goes when it
// is killed. Peers of another uid are child processes that switch to uid 65534 (nobody) before
// they connect: the kernel then tells verifyd that uid, as for any other user's process.

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "src/channel/channel_client.h"
#include "src/channel/channel_layout.h"
#include "tests/service/daemon_fixture.h"
#include "tests/service/peer_process.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd::testing {
namespace {

constexpr uid_t kNobody = 65534;

class TenancyTest : public DaemonTest {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a peer as another user";
    dir_ = TestDir("tenancy");
    DaemonOptions o = TestOptions(dir_);
    o.regions.max_total_bytes = uint64_t{1} << 30;
    o.regions.reap_every = absl::Milliseconds(50);
    o.handler.oracle_sample_rate = 0;
    StartDaemon(std::move(o));
    data_ = daemon_->listen_addresses()[1];
    // The socket's group would let a second user in; here anyone may connect.
    ASSERT_EQ(::chmod((dir_ + "/data.sock").c_str(), 0777), 0) << std::strerror(errno);
    owner_ = v1::VerifyService::NewStub(Channel(data_));
    nobody_ = PeerProcess::Connect(data_, kNobody);
    ASSERT_NE(nobody_, nullptr);
  }
  std::string Me() const {
    return "uid " + std::to_string(::geteuid()) + " pid " + std::to_string(::getpid());
  }
  grpc::Status RegisterShm(const std::string& name, const ShmObject& shm, const std::string& client,
                           v1::VerifyService::Stub* via) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name);
    req.set_key(shm.key());
    req.set_byte_size(shm.size());
    req.set_client(client);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return via->RegisterShmRegion(&ctx, req, &resp);
  }
  grpc::Status Unregister(const std::string& name, const std::string& client,
                          v1::VerifyService::Stub* via, v1::UnregisterRegionResponse* resp) {
    v1::UnregisterRegionRequest req;
    req.set_name(name);
    req.set_client(client);
    grpc::ClientContext ctx;
    return via->UnregisterRegion(&ctx, req, resp);
  }
  v1::ListRegionsResponse List(v1::VerifyService::Stub* via) {
    v1::ListRegionsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(via->ListRegions(&ctx, v1::ListRegionsRequest(), &resp).ok());
    return resp;
  }
  grpc::Status Call(const v1::VerifyRequest& req, v1::VerifyService::Stub* via,
                    v1::VerifyResponse* resp) {
    grpc::ClientContext ctx;
    return via->Verify(&ctx, req, resp);
  }
  grpc::Status CloseChannel(const std::string& name, const std::string& client,
                            v1::VerifyService::Stub* via, v1::CloseChannelResponse* resp) {
    v1::CloseChannelRequest req;
    req.set_name(name);
    req.set_client(client);
    grpc::ClientContext ctx;
    return via->CloseChannel(&ctx, req, resp);
  }
  std::string Audit() const {
    std::ifstream f(dir_ + "/state/audit.jsonl");
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  std::string Metrics() { return Scrape(daemon_->metrics_port()); }
  // Waits (at most 5 s) until `done` holds.
  template <typename F>
  static bool WaitFor(F done) {
    for (int i = 0; i < 500 && !done(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return done();
  }

  std::string dir_, data_;
  std::unique_ptr<v1::VerifyService::Stub> owner_;
  std::unique_ptr<PeerProcess> nobody_;
};

TEST_F(TenancyTest, AnotherUsersRegionCannotBeReadWrittenListedOrUnregistered) {
  RandomBundle b(RegionBundleSpec(71, 16, 3, 100));
  const ShmLayout l = ShmLayout::Of(b.view());
  ShmObject shm("victim", l.end);
  v1::VerifyRequest in_region;
  EncodeRequest(b.view(), &in_region);
  PutInShm(b.view(), l, shm.data(), "pool", &in_region);
  ASSERT_TRUE(RegisterShm("pool", shm, "victim", owner_.get()).ok());
  v1::VerifyResponse resp;
  ASSERT_TRUE(Call(in_region, owner_.get(), &resp).ok());
  const std::string before(shm.data(), shm.size());
  v1::VerifyService::Stub* mallory = nobody_->stub();

  // Read: a call naming the region for its inputs.
  grpc::Status st = Call(in_region, mallory, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  // The first tensor resolved names its field: kv_lens, say.
  EXPECT_NE(st.error_message().find(": region 'pool' belongs to " + Me() +
                                    ", not to the caller (uid 65534 pid "),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(resp.o().raw_contents().size(), 0u);
  // Write: inline inputs, o_out in the region.
  v1::VerifyRequest write;
  EncodeRequest(b.view(), &write);
  *write.mutable_o_out() = in_region.o_out();
  write.set_want_lse(false);
  st = Call(write, mallory, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("o_out: region 'pool' belongs to", 0), 0u)
      << st.error_message();
  EXPECT_TRUE(std::string(shm.data(), shm.size()) == before) << "the region was written";

  // Unregister by name, and by the owner's client name.
  v1::UnregisterRegionResponse un;
  st = Unregister("pool", "", mallory, &un);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("name: region 'pool' belongs to " + Me(), 0), 0u)
      << st.error_message();
  st = Unregister("", "victim", mallory, &un);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(un.unregistered_size(), 0);

  // List: nothing of the owner's.
  const v1::ListRegionsResponse theirs = List(mallory);
  EXPECT_EQ(theirs.regions_size(), 0) << theirs.DebugString();
  EXPECT_EQ(theirs.uid_region_count(), 0);
  EXPECT_EQ(theirs.region_sharing(), "uid");
  EXPECT_EQ(theirs.max_regions_per_uid(), 512);
  EXPECT_EQ(List(owner_.get()).regions_size(), 1);

  // The owner is served as before, from its region, and its region is whole.
  resp.Clear();
  ASSERT_TRUE(Call(in_region, owner_.get(), &resp).ok());
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();

  const std::string m = Metrics();
  EXPECT_NE(m.find("verifyd_tenancy_refusals_total{reason=\"not_owner\",resource=\"region\"} 3"),
            std::string::npos)
      << m.substr(m.find("verifyd_tenancy"), 400);
  const std::string audit = Audit();
  EXPECT_NE(audit.find("\"action\":\"denied\""), std::string::npos) << audit;
  EXPECT_NE(audit.find("uid 65534 pid "), std::string::npos) << audit;
  EXPECT_NE(audit.find("unregister region 'pool' of " + Me()), std::string::npos) << audit;
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
}

TEST_F(TenancyTest, AnotherUsersRegionSetMembersAreRefusedByIndex) {
  RandomBundle b(RegionBundleSpec(72, 1, 2, 37));
  const ShmLayout l = ShmLayout::Of(b.view());
  ShmObject shm("setvictim", l.end);
  v1::RegisterShmRegionSetRequest req;
  req.set_name("layers");
  req.set_client("victim");
  for (int i = 0; i < 3; ++i) {
    v1::ShmRegionSetMember* m = req.add_members();
    m->set_key(shm.key());
    m->set_byte_size(shm.size());
  }
  v1::RegisterRegionSetResponse reg;
  grpc::ClientContext ctx;
  ASSERT_TRUE(owner_->RegisterShmRegionSet(&ctx, req, &reg).ok());
  // Every tensor inline but the pool, which is member 2 of the set.
  v1::VerifyRequest inline_req;
  EncodeRequest(b.view(), &inline_req);
  {
    v1::VerifyRequest in_shm = inline_req;
    PutInShm(b.view(), l, shm.data(), "", &in_shm);
    *inline_req.mutable_kv_pool() = in_shm.kv_pool();
  }
  inline_req.mutable_kv_pool()->mutable_shm()->clear_region();
  inline_req.mutable_kv_pool()->mutable_shm()->set_set("layers");
  inline_req.mutable_kv_pool()->mutable_shm()->set_index(2);
  v1::VerifyResponse resp;
  grpc::Status st = Call(inline_req, nobody_->stub(), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("kv_pool: region set 'layers' belongs to " + Me(), 0), 0u)
      << st.error_message();
  EXPECT_TRUE(Call(inline_req, owner_.get(), &resp).ok());
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
  v1::UnregisterRegionResponse un;
  st = Unregister("layers", "", nobody_->stub(), &un);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(List(nobody_->stub()).sets_size(), 0);
  EXPECT_EQ(List(owner_.get()).sets_size(), 1);
}

TEST_F(TenancyTest, AnotherUsersChannelCannotBeClosedByNameOrClient) {
  channel::ChannelClientOptions o;
  o.name = "rank0";
  o.client = "victim";
  o.byte_size = 1 << 20;
  auto ch = channel::ChannelClient::Open(
      *owner_, [] { return std::make_unique<grpc::ClientContext>(); }, o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  v1::CloseChannelResponse closed;
  grpc::Status st = CloseChannel("rank0", "", nobody_->stub(), &closed);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("name: channel 'rank0' belongs to " + Me(), 0), 0u)
      << st.error_message();
  st = CloseChannel("", "victim", nobody_->stub(), &closed);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(closed.closed_size(), 0);
  ASSERT_EQ(Status().channels_size(), 1);
  v1::VerifyResponse resp;
  const absl::Status call = (*ch)->Call(SmallRequest(3), &resp);
  EXPECT_TRUE(call.ok()) << call;
  EXPECT_EQ(resp.error_code(), 0) << resp.error_message();
  const std::string m = Metrics();
  EXPECT_NE(m.find("verifyd_tenancy_refusals_total{reason=\"not_owner\",resource=\"channel\"} 1"),
            std::string::npos);
  EXPECT_NE(Audit().find("close channel 'rank0' of " + Me()), std::string::npos) << Audit();
}

// What a killed process registered goes within the reaper's period; another live process's
// regions of the same uid stay.
TEST_F(TenancyTest, AKilledProcessesRegionsAndSetsAreUnregistered) {
  auto rank = PeerProcess::Connect(data_);
  ASSERT_NE(rank, nullptr);
  ShmObject shm("dying", 1 << 16);
  ASSERT_TRUE(RegisterShm("dying", shm, "rank1", rank->stub()).ok());
  v1::RegisterShmRegionSetRequest req;
  req.set_name("dying-layers");
  for (int i = 0; i < 4; ++i) {
    v1::ShmRegionSetMember* m = req.add_members();
    m->set_key(shm.key());
    m->set_byte_size(4096);
  }
  v1::RegisterRegionSetResponse reg;
  grpc::ClientContext ctx;
  ASSERT_TRUE(rank->stub()->RegisterShmRegionSet(&ctx, req, &reg).ok());
  ASSERT_TRUE(RegisterShm("living", shm, "rank0", owner_.get()).ok());
  EXPECT_EQ(List(owner_.get()).region_count(), 6);

  rank->Kill();
  EXPECT_TRUE(WaitFor([&] { return List(owner_.get()).region_count() == 1; }))
      << List(owner_.get()).DebugString();
  const v1::ListRegionsResponse left = List(owner_.get());
  ASSERT_EQ(left.regions_size(), 1);
  EXPECT_EQ(left.regions(0).name(), "living");
  EXPECT_EQ(left.sets_size(), 0);
  EXPECT_NE(Metrics().find("verifyd_regions 1\n"), std::string::npos);
  // The names are free for the next process.
  EXPECT_TRUE(RegisterShm("dying", shm, "rank1", owner_.get()).ok());
}

// A process holds at most --max_channels_per_client channels; another process has its own.
TEST_F(TenancyTest, AProcessOpensAtMostItsShareOfChannels) {
  std::vector<std::unique_ptr<channel::ChannelClient>> open;
  const int cap = ChannelLimits{}.max_channels_per_client;
  absl::Status refused;
  for (int i = 0; i <= cap; ++i) {
    channel::ChannelClientOptions o;
    o.name = "c" + std::to_string(i);
    o.byte_size = channel::kMinBytes;
    auto ch = channel::ChannelClient::Open(
        *owner_, [] { return std::make_unique<grpc::ClientContext>(); }, o);
    if (ch.ok()) {
      open.push_back(std::move(*ch));
    } else {
      refused = ch.status();
    }
  }
  EXPECT_EQ(static_cast<int>(open.size()), cap);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max_channels_per_client"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find(Me()), std::string::npos) << refused;
  auto other = PeerProcess::Connect(data_);
  ASSERT_NE(other, nullptr);
  channel::ChannelClientOptions o;
  o.name = "other";
  o.byte_size = channel::kMinBytes;
  auto ch = channel::ChannelClient::Open(
      *other->stub(), [] { return std::make_unique<grpc::ClientContext>(); }, o);
  EXPECT_TRUE(ch.ok()) << ch.status();
}

}  // namespace
}  // namespace verifyd::testing
