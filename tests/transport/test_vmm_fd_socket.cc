// The descriptor socket that CUDA VMM chunks' descriptors arrive on: the payload's parsing, the
// inbox's token and uid bookkeeping (a set taken once and only by its sender's uid, expired sets
// closed, the limits), and the socket itself (descriptors passed with SCM_RIGHTS, each message
// answered "ok" or with the error naming the field, the socket serving on after a refusal).

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/transport/vmm_fd_inbox.h"
#include "src/transport/vmm_fd_payload.h"
#include "src/transport/vmm_fd_socket.h"
#include "tests/transport/vmm_fd_client.h"

namespace verifyd {
namespace {

const std::string kToken(16, '\x5a');

bool StartsWith(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(VmmFdPayload, ParsesWhatItWrites) {
  const std::string p = VmmFdPayload(kToken, 253, 600);
  ASSERT_EQ(p.size(), kVmmFdPayloadBytes);
  absl::StatusOr<VmmFdMessage> m = ParseVmmFdPayload(p, 253, 8192);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->token, kToken);
  EXPECT_EQ(m->first, 253u);
  EXPECT_EQ(m->total, 600u);
}

TEST(VmmFdPayload, RefusalsNameTheField) {
  const auto refused = [](const std::string& payload, size_t fds) {
    absl::StatusOr<VmmFdMessage> m = ParseVmmFdPayload(payload, fds, 100);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(m.status().message());
  };
  EXPECT_TRUE(StartsWith(refused("short", 1), "payload: 5 bytes")) << refused("short", 1);
  std::string bad_magic = VmmFdPayload(kToken, 0, 1);
  bad_magic[0] = 'X';
  EXPECT_TRUE(StartsWith(refused(bad_magic, 1), "magic:"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(std::string(16, '\0'), 0, 1), 1), "token:"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(kToken, 0, 1), 0), "fds: the message carries no"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(kToken, 0, 100), 254), "fds: 254"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(kToken, 0, 101), 1), "total: 101"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(kToken, 0, 0), 1), "total: 0"));
  EXPECT_TRUE(StartsWith(refused(VmmFdPayload(kToken, 3, 4), 2), "first:"));
}

class FakeClock {
 public:
  absl::Time now = absl::FromUnixSeconds(1000);
  std::function<absl::Time()> fn() {
    return [this] { return now; };
  }
};

VmmFdMessage Message(const std::string& token, uint32_t first, uint32_t total) {
  return VmmFdMessage{token, first, total};
}

TEST(VmmFdInbox, TakesACompleteSetOnceAndOnlyForItsUid) {
  FakeClock clock;
  VmmFdInbox inbox(VmmFdLimits{}, clock.fn());
  std::vector<UniqueFd> fds = PipeFds(3);
  const int first_fd = fds[0].get();
  ASSERT_TRUE(inbox.Deposit(Message(kToken, 0, 3), std::move(fds), 1000, 42).ok());
  EXPECT_EQ(inbox.fds(), 3);

  absl::StatusOr<std::vector<UniqueFd>> other = inbox.Take(kToken, 1001);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(StartsWith(std::string(other.status().message()), "token:"));
  EXPECT_EQ(inbox.tokens(), 1);  // still there for its owner

  absl::StatusOr<std::vector<UniqueFd>> mine = inbox.Take(kToken, 1000);
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_EQ(mine->size(), 3u);
  EXPECT_EQ((*mine)[0].get(), first_fd);
  EXPECT_EQ(inbox.tokens(), 0);
  EXPECT_EQ(inbox.fds(), 0);

  absl::StatusOr<std::vector<UniqueFd>> again = inbox.Take(kToken, 1000);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StartsWith(std::string(again.status().message()), "token:"));
}

TEST(VmmFdInbox, ASetInSeveralMessagesMustArriveInOrderFromOneUid) {
  FakeClock clock;
  VmmFdInbox inbox(VmmFdLimits{}, clock.fn());
  absl::Status st = inbox.Deposit(Message(kToken, 2, 4), PipeFds(2), 1000, 1);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "first: 2")) << st;
  ASSERT_TRUE(inbox.Deposit(Message(kToken, 0, 4), PipeFds(2), 1000, 1).ok());
  absl::StatusOr<std::vector<UniqueFd>> early = inbox.Take(kToken, 1000);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(StartsWith(std::string(early.status().message()), "token: 2 of its 4"))
      << early.status();
  st = inbox.Deposit(Message(kToken, 2, 4), PipeFds(2), 1001, 2);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "token:")) << st;
  st = inbox.Deposit(Message(kToken, 2, 5), PipeFds(2), 1000, 1);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "total: 5")) << st;
  st = inbox.Deposit(Message(kToken, 1, 4), PipeFds(2), 1000, 1);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "first: 1, expected 2")) << st;
  ASSERT_TRUE(inbox.Deposit(Message(kToken, 2, 4), PipeFds(2), 1000, 1).ok());
  absl::StatusOr<std::vector<UniqueFd>> all = inbox.Take(kToken, 1000);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 4u);
}

TEST(VmmFdInbox, ExpiredSetsAreClosed) {
  FakeClock clock;
  VmmFdLimits limits;
  limits.ttl = absl::Seconds(60);
  VmmFdInbox inbox(limits, clock.fn());
  std::vector<UniqueFd> fds = PipeFds(2);
  const int fd = fds[0].get();
  ASSERT_TRUE(inbox.Deposit(Message(kToken, 0, 2), std::move(fds), 1000, 1).ok());
  clock.now += absl::Seconds(59);
  inbox.Expire();
  EXPECT_TRUE(IsOpen(fd));
  clock.now += absl::Seconds(2);
  inbox.Expire();
  EXPECT_FALSE(IsOpen(fd));
  EXPECT_EQ(inbox.fds(), 0);
  absl::StatusOr<std::vector<UniqueFd>> late = inbox.Take(kToken, 1000);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StartsWith(std::string(late.status().message()), "token:"));
}

TEST(VmmFdInbox, LimitsOnTokensAndDescriptors) {
  FakeClock clock;
  VmmFdLimits limits;
  limits.max_tokens = 2;
  limits.max_fds = 5;
  VmmFdInbox inbox(limits, clock.fn());
  ASSERT_TRUE(inbox.Deposit(Message(std::string(16, 'a'), 0, 3), PipeFds(3), 1000, 1).ok());
  ASSERT_TRUE(inbox.Deposit(Message(std::string(16, 'b'), 0, 1), PipeFds(1), 1000, 1).ok());
  std::vector<UniqueFd> refused = PipeFds(1);
  const int fd = refused[0].get();
  absl::Status st = inbox.Deposit(Message(std::string(16, 'c'), 0, 1), std::move(refused), 1000, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "token: 2 tokens")) << st;
  EXPECT_FALSE(IsOpen(fd));  // a refused message's descriptors are closed
  st = inbox.Deposit(Message(std::string(16, 'a'), 3, 6), PipeFds(2), 1000, 1);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "total: 6")) << st;
  ASSERT_TRUE(inbox.Take(std::string(16, 'b'), 1000).ok());
  st = inbox.Deposit(Message(std::string(16, 'd'), 0, 3), PipeFds(3), 1000, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(StartsWith(std::string(st.message()), "fds: 3 descriptors are held")) << st;
}

class VmmFdSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/vdfds-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = VmmFdSocket::PathFor(dir_ + "/data.sock");
    inbox_ = std::make_unique<VmmFdInbox>(VmmFdLimits{});
    absl::StatusOr<std::unique_ptr<VmmFdSocket>> s =
        VmmFdSocket::Start("listen", path_, SocketAccess{0660, ""}, inbox_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    socket_ = std::move(*s);
  }
  void TearDown() override {
    socket_.reset();
    ::rmdir(dir_.c_str());
  }
  std::string dir_, path_;
  std::unique_ptr<VmmFdInbox> inbox_;
  std::unique_ptr<VmmFdSocket> socket_;
};

TEST_F(VmmFdSocketTest, HasTheDataSocketsModeAndGoesWithTheSocket) {
  EXPECT_EQ(path_, dir_ + "/data.sock.fds");
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  socket_.reset();
  EXPECT_NE(::stat(path_.c_str(), &st), 0);
}

TEST_F(VmmFdSocketTest, DescriptorsArriveWithTheSendersUid) {
  FdClient c(path_);
  ASSERT_TRUE(c.connected());
  EXPECT_EQ(c.Send(VmmFdPayload(kToken, 0, 5), PipeFds(3)), "ok");
  EXPECT_EQ(c.Send(VmmFdPayload(kToken, 3, 5), PipeFds(2)), "ok");
  EXPECT_EQ(inbox_->fds(), 5);
  // Another uid cannot take them (the test runs as one uid: the inbox is asked as another).
  EXPECT_EQ(inbox_->Take(kToken, ::getuid() + 1).status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::vector<UniqueFd>> fds = inbox_->Take(kToken, ::getuid());
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 5u);
  for (const UniqueFd& fd : *fds) EXPECT_TRUE(IsOpen(fd.get()));
}

TEST_F(VmmFdSocketTest, RefusedMessagesNameTheFieldAndTheSocketServesOn) {
  FdClient c(path_);
  ASSERT_TRUE(c.connected());
  EXPECT_TRUE(StartsWith(c.Send(VmmFdPayload(kToken, 0, 1), {}), "fds: the message carries no"));
  EXPECT_TRUE(StartsWith(c.Send("hello", PipeFds(1)), "payload: 5 bytes"));
  EXPECT_TRUE(StartsWith(c.Send(std::string(64, 'x'), PipeFds(1)), "payload: longer than 28"));
  EXPECT_TRUE(StartsWith(c.Send(VmmFdPayload(std::string(16, '\0'), 0, 1), PipeFds(1)), "token:"));
  EXPECT_TRUE(StartsWith(c.Send(VmmFdPayload(kToken, 0, 9000), PipeFds(1)), "total: 9000"));
  EXPECT_TRUE(StartsWith(c.Send(VmmFdPayload(kToken, 1, 2), PipeFds(1)), "first: 1"));
  EXPECT_EQ(inbox_->fds(), 0);  // nothing refused was kept
  // The same connection, and a new one, are still served.
  EXPECT_EQ(c.Send(VmmFdPayload(kToken, 0, 1), PipeFds(1)), "ok");
  FdClient d(path_);
  ASSERT_TRUE(d.connected());
  EXPECT_EQ(d.Send(VmmFdPayload(std::string(16, 'q'), 0, 253), PipeFds(253)), "ok");
  EXPECT_EQ(inbox_->fds(), 254);
}

}  // namespace
}  // namespace verifyd
