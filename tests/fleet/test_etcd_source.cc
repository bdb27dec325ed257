// The etcd source against a real etcd (/usr/bin/etcd, Debian's etcd-server) on loopback ports of
// its own: the desired state Put by a client is proposed, a new generation acted on, a torn value
// or a deleted key is a source down that keeps the mode, the node's status key says what the
// node did and goes with its lease, and an etcd killed and restarted on the same data directory
// is a source down, then up again with what was written meanwhile acted on.

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcdserverpb/rpc.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "src/fleet/etcd_client.h"
#include "src/fleet/etcd_source.h"
#include "src/fleet/fleet_follower.h"
#include "tests/fleet/fleet_proposals.h"

namespace verifyd::fleet {
namespace {

namespace fs = std::filesystem;
constexpr char kEtcd[] = "/usr/bin/etcd";

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

template <typename F>
bool WaitFor(F done, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// One etcd member on two free loopback ports, its data in a temporary directory.
class EtcdServer {
 public:
  EtcdServer() : client_port_(FreePort()), peer_port_(FreePort()) {
    char tmpl[] = "/tmp/verifyd-etcd-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  ~EtcdServer() {
    Kill();
    fs::remove_all(dir_);
  }
  std::string endpoint() const { return absl::StrCat("127.0.0.1:", client_port_); }

  // Starts it (on the same data directory after a Kill) and waits until it answers.
  bool Start() {
    const std::string client = absl::StrCat("http://127.0.0.1:", client_port_);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    std::vector<std::string> args = {kEtcd,
                                     "--name=t",
                                     "--data-dir=" + dir_ + "/data",
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=t=" + peer,
                                     "--log-level=warn"};
    pid_ = fork();
    if (pid_ == 0) {
      const int log = open((dir_ + "/etcd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(log, 1);
      dup2(log, 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(kEtcd, argv.data());
      _exit(127);
    }
    auto kv = etcdserverpb::KV::NewStub(
        grpc::CreateChannel(endpoint(), grpc::InsecureChannelCredentials()));
    return WaitFor(
        [&] {
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
          ctx.set_wait_for_ready(true);
          etcdserverpb::RangeRequest req;
          etcdserverpb::RangeResponse resp;
          req.set_key("ping");
          return kv->Range(&ctx, req, &resp).ok();
        },
        20);
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  const int client_port_, peer_port_;
  std::string dir_;
  pid_t pid_ = -1;
};

// A client of the test's own, on the same protos as the source, and on the source's kind of
// channel: gRPC's default one, after etcd is killed and started again, may wait longer than a
// call's deadline to reconnect (its backoff grows from 1 s by 1.6x an attempt).
class Client {
 public:
  explicit Client(const std::string& endpoint)
      : kv_(etcdserverpb::KV::NewStub(MakeEtcdChannel(endpoint))) {}
  bool Put(const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.set_wait_for_ready(true);
    etcdserverpb::PutRequest req;
    etcdserverpb::PutResponse resp;
    req.set_key(key);
    req.set_value(value);
    return kv_->Put(&ctx, req, &resp).ok();
  }
  bool Delete(const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    etcdserverpb::DeleteRangeRequest req;
    etcdserverpb::DeleteRangeResponse resp;
    req.set_key(key);
    return kv_->DeleteRange(&ctx, req, &resp).ok();
  }
  // The key's value and lease; nothing when it does not exist.
  std::optional<std::pair<std::string, int64_t>> Get(const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    etcdserverpb::RangeRequest req;
    etcdserverpb::RangeResponse resp;
    req.set_key(key);
    if (!kv_->Range(&ctx, req, &resp).ok() || resp.kvs().empty()) return std::nullopt;
    return std::make_pair(resp.kvs(0).value(), resp.kvs(0).lease());
  }

 private:
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
};

constexpr char kPrefix[] = "/verifyd/test";
constexpr char kDesired[] = "/verifyd/test/desired";
constexpr char kBuild[] = "0123456789ab";

// A follower with the etcd source, as the daemon wires them.
struct Node {
  Node(const std::string& endpoint, Proposals* p, const std::string& name = "node-a") {
    FollowerOptions fo;
    fo.node = name;
    fo.build = kBuild;
    fo.source = absl::StrCat("etcd ", endpoint, kDesired);
    follower = std::make_unique<FleetFollower>(fo, p->fn());
    EtcdOptions eo;
    eo.endpoints = {endpoint};
    eo.prefix = kPrefix;
    eo.node = name;
    eo.build = kBuild;
    eo.report_period = absl::Milliseconds(500);
    source = std::make_unique<EtcdSource>(eo, follower.get(), [] {
      NodeState s;
      s.mode = "canary";
      s.canary_fraction = 0.25;
      s.gate_open = true;
      return s;
    });
    source->Start();
  }
  std::unique_ptr<FleetFollower> follower;
  std::unique_ptr<EtcdSource> source;
};

class EtcdSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kEtcd, X_OK) != 0) {
      GTEST_SKIP() << kEtcd << " is absent: install Debian's etcd-server (scripts/install_deps.sh)";
    }
    etcd_ = std::make_unique<EtcdServer>();
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start";
    client_ = std::make_unique<Client>(etcd_->endpoint());
  }
  std::unique_ptr<EtcdServer> etcd_;
  std::unique_ptr<Client> client_;
};

TEST(EtcdEndpoints, Parse) {
  auto e = ParseEtcdEndpoints("10.0.0.1:2379, etcd-1.internal:2379");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(*e, (std::vector<std::string>{"10.0.0.1:2379", "etcd-1.internal:2379"}));
  EXPECT_FALSE(ParseEtcdEndpoints("").ok());
  EXPECT_FALSE(ParseEtcdEndpoints("etcd-1").ok());
  EXPECT_FALSE(ParseEtcdEndpoints("etcd-1:").ok());
}

TEST_F(EtcdSourceTest, TheStateIsProposedAndEachNewGenerationActedOn) {
  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 1, "mode": "shadow"})"));
  Proposals p;
  p.takes = absl::Milliseconds(100);
  Node n(etcd_->endpoint(), &p);
  ASSERT_TRUE(WaitFor([&] { return p.count() == 1; }, 2)) << "the key was not read";
  EXPECT_EQ(p.last(), "shadow 0 | fleet generation 1 (in its step)");
  EXPECT_TRUE(n.follower->status().source_up);

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(client_->Put(
      kDesired, R"({"generation": 2, "mode": "canary", "canary_fraction": 0.25, "reason": "r1"})"));
  ASSERT_TRUE(WaitFor([&] { return p.count() == 2; }, 2)) << "the watch did not deliver it";
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_EQ(p.last(), "canary 0.25 | fleet generation 2 (in its step): r1");
  // Acted once the proposal returns.
  EXPECT_TRUE(WaitFor([&] { return n.follower->status().generation_acted == 2; }, 2))
      << n.follower->status().generation_acted;
  // The same generation written again proposes nothing.
  ASSERT_TRUE(client_->Put(
      kDesired, R"({"generation": 2, "mode": "canary", "canary_fraction": 0.25, "reason": "r1"})"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(p.count(), 2u);
}

TEST_F(EtcdSourceTest, ATornValueOrADeletedKeyIsASourceDownAndTheModeIsKept) {
  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 1, "mode": "custom"})"));
  Proposals p;
  Node n(etcd_->endpoint(), &p);
  ASSERT_TRUE(WaitFor([&] { return p.count() == 1; }, 2));

  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 2, "mo)"));
  ASSERT_TRUE(WaitFor([&] { return !n.follower->status().source_up; }, 2));
  EXPECT_EQ(n.follower->status().source_error.find("desired state: not JSON"), 0u)
      << n.follower->status().source_error;
  EXPECT_EQ(p.count(), 1u);
  EXPECT_EQ(n.follower->status().generation_acted, 1);

  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 2, "mode": "shadow"})"));
  ASSERT_TRUE(WaitFor([&] { return p.count() == 2; }, 2));
  EXPECT_TRUE(n.follower->status().source_up);

  ASSERT_TRUE(client_->Delete(kDesired));
  ASSERT_TRUE(WaitFor([&] { return !n.follower->status().source_up; }, 2));
  EXPECT_NE(n.follower->status().source_error.find("key deleted"), std::string::npos)
      << n.follower->status().source_error;
  EXPECT_EQ(p.count(), 2u);
}

TEST_F(EtcdSourceTest, TheNodesStatusKeySaysWhatItDidAndGoesWithItsLease) {
  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 4, "mode": "canary",
                                        "canary_fraction": 0.25, "reason": "r4"})"));
  Proposals p;
  {
    absl::MutexLock l(&p.mu);
    p.answer = absl::FailedPreconditionError("gate closed: 12 of 1000 clean comparisons");
  }
  const std::string key = absl::StrCat(kPrefix, "/nodes/node-a");
  auto n = std::make_unique<Node>(etcd_->endpoint(), &p);
  nlohmann::json j;
  int64_t lease = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto v = client_->Get(key);
        if (!v) return false;
        j = nlohmann::json::parse(v->first);
        lease = v->second;
        return j["generation_acted"] == 4;
      },
      3))
      << j.dump();
  EXPECT_EQ(j["node"], "node-a");
  EXPECT_EQ(j["mode"], "canary");
  EXPECT_EQ(j["canary_fraction"], 0.25);
  EXPECT_EQ(j["gate"], "open");
  EXPECT_EQ(j["generation_seen"], 4);
  EXPECT_EQ(j["last_outcome"], "refused");
  EXPECT_NE(j["last_detail"].get<std::string>().find("gate closed: 12 of 1000"), std::string::npos);
  EXPECT_EQ(j["source_up"], true);
  EXPECT_EQ(j["build"], kBuild);
  EXPECT_FALSE(j["time"].get<std::string>().empty());
  EXPECT_NE(lease, 0) << "the status key has no lease";
  EXPECT_EQ(lease, n->source->lease_id());

  n.reset();  // revokes the lease: the key goes now
  EXPECT_FALSE(client_->Get(key).has_value());
}

TEST_F(EtcdSourceTest, AKilledEtcdIsASourceDownAndItsReturnIsFollowed) {
  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 1, "mode": "shadow"})"));
  Proposals p;
  Node n(etcd_->endpoint(), &p);
  ASSERT_TRUE(WaitFor([&] { return p.count() == 1; }, 2));

  etcd_->Kill();
  ASSERT_TRUE(WaitFor([&] { return !n.follower->status().source_up; }, 10));
  EXPECT_NE(n.follower->status().source_error.find("etcd " + etcd_->endpoint()), std::string::npos)
      << n.follower->status().source_error;
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // reconnect attempts fail
  EXPECT_FALSE(n.follower->status().source_up);
  EXPECT_EQ(p.count(), 1u);

  ASSERT_TRUE(etcd_->Start());
  ASSERT_TRUE(client_->Put(kDesired, R"({"generation": 2, "mode": "canary",
                                        "canary_fraction": 0.5})"));
  // Generous: under a loaded machine etcd's start and the source's reconnect (at most a second
  // apart) can take seconds; a follower that never reconnects still fails here.
  ASSERT_TRUE(WaitFor([&] { return p.count() == 2; }, 15)) << n.follower->status().source_error;
  EXPECT_EQ(p.last(), "canary 0.5 | fleet generation 2 (in its step)");
  EXPECT_TRUE(n.follower->status().source_up);
  // The status key is back too (under a lease granted anew if the old one ran out).
  EXPECT_TRUE(
      WaitFor([&] { return client_->Get(absl::StrCat(kPrefix, "/nodes/node-a")).has_value(); }, 3));
}

}  // namespace
}  // namespace verifyd::fleet
