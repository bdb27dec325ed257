// One verifyd per state dir and per address: a second daemon on anything the first uses is
// refused with a reason naming the other, and the first keeps serving. Unix socket setup removes
// only stale sockets.

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;
using testing::DaemonTest;

class SingleInstanceTest : public DaemonTest {
 protected:
  void SetUp() override {
    dir_ = testing::TestDir("single");
    StartDaemon(testing::TestOptions(dir_));
  }
  // A second daemon's options that share nothing with the first.
  DaemonOptions Other() {
    other_dir_ = dir_ + "/other";
    fs::create_directories(other_dir_);
    return testing::TestOptions(other_dir_);
  }
  // The second daemon must fail with a reason containing `why`.
  void ExpectRefused(DaemonOptions o, const std::string& why) {
    auto second = Daemon::Start(std::move(o));
    ASSERT_FALSE(second.ok()) << "a second daemon started on top of the first";
    EXPECT_NE(second.status().message().find(why), std::string::npos) << second.status();
    EXPECT_EQ(std::string(second.status().message()).find('\n'), std::string::npos);
  }
  // The first daemon still answers every call on both services and /metrics.
  void ExpectFirstServes() {
    for (int i = 0; i < 8; ++i) {
      v1::VerifyResponse resp;
      ASSERT_TRUE(Verify(testing::SmallRequest(100 + i), &resp).ok());
    }
    EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
    auto unix_stub = v1::VerifyService::NewStub(testing::Channel(daemon_->listen_addresses()[1]));
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    EXPECT_TRUE(unix_stub->Verify(&ctx, testing::SmallRequest(7), &resp).ok());
    EXPECT_NE(testing::Scrape(daemon_->metrics_port()).find("verifyd_requests_total"),
              std::string::npos);
  }
  std::string dir_, other_dir_;
};

TEST_F(SingleInstanceTest, SameStateDirIsRefusedNamingTheHoldersPid) {
  DaemonOptions o = Other();
  o.state_dir = dir_ + "/state";
  ExpectRefused(o, absl::StrCat("state_dir ", dir_, "/state is locked by pid ", getpid()));
  ExpectFirstServes();
  std::ifstream lock(dir_ + "/state/verifyd.lock");
  int64_t pid = 0;
  lock >> pid;
  EXPECT_EQ(pid, getpid());
}

TEST_F(SingleInstanceTest, TheStateDirLockIsReleasedWithTheDaemon) {
  daemon_.reset();
  DaemonOptions o = Other();
  o.state_dir = dir_ + "/state";
  auto again = Daemon::Start(o);
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(SingleInstanceTest, SameTcpListenIsRefused) {
  DaemonOptions o = Other();
  o.listen = {tcp_};
  ExpectRefused(o, absl::StrCat("listen: ", tcp_, " is in use by another process"));
  ExpectFirstServes();
}

TEST_F(SingleInstanceTest, SameMetricsPortIsRefused) {
  DaemonOptions o = Other();
  const std::string addr = absl::StrCat("127.0.0.1:", daemon_->metrics_port());
  o.metrics_address = addr;
  ExpectRefused(o, absl::StrCat("metrics_address: ", addr, " is in use by another process"));
  ExpectFirstServes();
}

TEST_F(SingleInstanceTest, SameTcpAdminListenIsRefused) {
  // The first daemon's admin moves to TCP for this one.
  daemon_.reset();
  DaemonOptions first = testing::TestOptions(dir_);
  first.admin_listen = "127.0.0.1:0";
  first.admin_token = "t0ken";
  first.insecure_admin_tcp = true;
  StartDaemon(first);
  DaemonOptions o = Other();
  o.admin_listen = daemon_->admin_address();
  o.admin_token = "t0ken";
  o.insecure_admin_tcp = true;
  ExpectRefused(
      o, absl::StrCat("admin_listen: ", daemon_->admin_address(), " is in use by another process"));
}

TEST_F(SingleInstanceTest, SameAdminSocketIsRefusedAndKept) {
  DaemonOptions o = Other();
  o.admin_listen = daemon_->admin_address();
  ExpectRefused(
      o, absl::StrCat("admin_listen: ", daemon_->admin_address(), " is in use by pid ", getpid()));
  ExpectFirstServes();
  EXPECT_TRUE(fs::is_socket(dir_ + "/admin.sock"));
}

TEST_F(SingleInstanceTest, SameDataSocketIsRefusedAndKept) {
  DaemonOptions o = Other();
  o.listen = {"127.0.0.1:0", daemon_->listen_addresses()[1]};
  ExpectRefused(o, absl::StrCat("listen: ", daemon_->listen_addresses()[1], " is in use by pid "));
  ExpectFirstServes();
}

// Unix socket setup: only a stale socket is removed.
class UnixSocketPathTest : public DaemonTest {
 protected:
  void SetUp() override { dir_ = testing::TestDir("sockpath"); }
  std::string dir_;
};

TEST_F(UnixSocketPathTest, ARegularFileAtTheAdminPathIsRefusedAndKept) {
  DaemonOptions o = testing::TestOptions(dir_);
  const std::string path = dir_ + "/admin.sock";
  std::ofstream(path) << "precious";
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(), absl::StrCat("admin_listen: unix:", path,
                                               " exists and is not a socket; refusing to "
                                               "remove it"));
  std::ifstream in(path);
  std::string content;
  in >> content;
  EXPECT_EQ(content, "precious");
}

TEST_F(UnixSocketPathTest, ADirectoryAtTheDataPathIsRefusedAndKept) {
  DaemonOptions o = testing::TestOptions(dir_);
  fs::create_directories(dir_ + "/data.sock/inside");
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("listen: unix:" + dir_ +
                                      "/data.sock exists and is not a "
                                      "socket"),
            std::string::npos)
      << d.status();
  EXPECT_TRUE(fs::is_directory(dir_ + "/data.sock/inside"));
}

TEST_F(UnixSocketPathTest, AStaleSocketIsReplaced) {
  // A socket left by a process that died: bound, never listening, its file still there.
  const std::string path = dir_ + "/admin.sock";
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(s);
  ASSERT_TRUE(fs::is_socket(path));
  StartDaemon(testing::TestOptions(dir_));
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
}

TEST_F(UnixSocketPathTest, AMissingParentDirectoryIsCreated) {
  DaemonOptions o = testing::TestOptions(dir_);
  o.admin_listen = "unix:" + dir_ + "/run/verifyd/admin.sock";
  StartDaemon(o);
  EXPECT_EQ(Status().mode(), v1::MODE_SHADOW);
  EXPECT_EQ(fs::status(dir_ + "/run/verifyd").permissions() & fs::perms::all, fs::perms(0755));
}

TEST_F(UnixSocketPathTest, AnUncreatableParentDirectoryIsAClearError) {
  DaemonOptions o = testing::TestOptions(dir_);
  std::ofstream(dir_ + "/file") << "x";
  o.admin_listen = "unix:" + dir_ + "/file/admin.sock";
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("admin_listen: unix:" + dir_ +
                                      "/file/admin.sock: cannot create the directory"),
            std::string::npos)
      << d.status();
}

}  // namespace
}  // namespace verifyd
