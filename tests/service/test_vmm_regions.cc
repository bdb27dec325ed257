// RegisterCudaVmmRegion end to end on a daemon: the descriptor socket next to the Unix data
// socket, and the call that names a token. A bad token, one already taken, a call over TCP and
// one without descriptors are refused naming the field, and the daemon keeps serving; on the CPU
// engine a complete set is refused with FAILED_PRECONDITION naming the engine, as
// RegisterCudaRegion is. (The GPU path: tests/python/gpu_vmm_test.py.)

#include <sys/stat.h>

#include <string>
#include <vector>

#include "src/transport/vmm_fd_payload.h"
#include "src/transport/vmm_fd_socket.h"
#include "tests/service/daemon_fixture.h"
#include "tests/transport/vmm_fd_client.h"

namespace verifyd::testing {
namespace {

const std::string kToken(16, '\x7e');

bool StartsWith(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

class VmmRegionTest : public DaemonTest {
 protected:
  void SetUp() override {
    dir_ = TestDir("vmm");
    DaemonOptions o = TestOptions(dir_);
    o.regions.max_regions = 8;
    o.handler.oracle_sample_rate = 0;
    StartDaemon(std::move(o));
    unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
    fds_path_ = VmmFdSocket::PathFor(dir_ + "/data.sock");
  }
  grpc::Status Register(const std::string& token, std::vector<uint64_t> chunks,
                        v1::VerifyService::Stub* via = nullptr) {
    v1::RegisterCudaVmmRegionRequest req;
    req.set_name("pool");
    req.set_token(token);
    for (uint64_t c : chunks) req.add_chunks(c);
    req.set_byte_size(1 << 20);
    req.set_client("rank0");
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return (via ? via : unix_.get())->RegisterCudaVmmRegion(&ctx, req, &resp);
  }
  // The daemon still answers region calls.
  void ExpectServing() {
    v1::ListRegionsResponse list;
    grpc::ClientContext ctx;
    EXPECT_TRUE(unix_->ListRegions(&ctx, v1::ListRegionsRequest(), &list).ok());
    EXPECT_EQ(list.regions_size(), 0);
  }
  std::string dir_, fds_path_;
  std::unique_ptr<v1::VerifyService::Stub> unix_;
};

TEST_F(VmmRegionTest, TheDescriptorSocketSitsNextToTheDataSocket) {
  struct stat data {
  }, fds{};
  ASSERT_EQ(::stat((dir_ + "/data.sock").c_str(), &data), 0);
  ASSERT_EQ(::stat(fds_path_.c_str(), &fds), 0);
  EXPECT_TRUE(S_ISSOCK(fds.st_mode));
  EXPECT_EQ(fds.st_mode & 0777, data.st_mode & 0777);
  EXPECT_EQ(fds.st_gid, data.st_gid);
}

TEST_F(VmmRegionTest, BadTokensAreRefusedNamingTheField) {
  grpc::Status st = Register(kToken, {2 << 20});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_TRUE(StartsWith(st.error_message(), "token: verifyd holds no descriptors"))
      << st.error_message();
  st = Register("short", {2 << 20});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(StartsWith(st.error_message(), "token: 5 bytes")) << st.error_message();

  // Descriptors sent, then named over TCP: refused there, still held for the Unix socket.
  FdClient c(fds_path_);
  ASSERT_TRUE(c.connected());
  EXPECT_EQ(c.Send(VmmFdPayload(kToken, 0, 2), PipeFds(2)), "ok");
  EXPECT_TRUE(StartsWith(c.Send(VmmFdPayload(kToken, 2, 2), {}), "fds: the message carries no"));
  st = Register(kToken, {2 << 20, 2 << 20}, verify_.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_TRUE(StartsWith(st.error_message(), "RegisterCudaVmmRegion:")) << st.error_message();

  // The count of chunks must be the count of descriptors; the set is used up either way.
  st = Register(kToken, {2 << 20});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(StartsWith(st.error_message(), "chunks: 1 chunk sizes for the 2 descriptors"))
      << st.error_message();
  st = Register(kToken, {2 << 20, 2 << 20});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  ExpectServing();
}

TEST_F(VmmRegionTest, ACompleteSetIsImportedOnTheEnginesGpu) {
  FdClient c(fds_path_);
  ASSERT_TRUE(c.connected());
  EXPECT_EQ(c.Send(VmmFdPayload(kToken, 0, 1), PipeFds(1)), "ok");
  const grpc::Status st = Register(kToken, {2 << 20});
  if (TestEngine() == "cpu") {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_TRUE(StartsWith(st.error_message(), "chunks: this engine has no GPU"))
        << st.error_message();
  } else {  // a pipe is not a CUDA allocation
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(StartsWith(st.error_message(), "chunks[0]: cuMemImportFromShareableHandle"))
        << st.error_message();
  }
  ExpectServing();
}

TEST_F(VmmRegionTest, ChunkSizesAreCheckedBeforeAnyImport) {
  FdClient c(fds_path_);
  ASSERT_TRUE(c.connected());
  const auto refused = [&](std::vector<uint64_t> chunks, uint64_t offset, uint64_t bytes) {
    EXPECT_EQ(c.Send(VmmFdPayload(kToken, 0, static_cast<uint32_t>(chunks.size())),
                     PipeFds(static_cast<int>(chunks.size()))),
              "ok");
    v1::RegisterCudaVmmRegionRequest req;
    req.set_name("pool");
    req.set_token(kToken);
    for (uint64_t ch : chunks) req.add_chunks(ch);
    req.set_offset(offset);
    req.set_byte_size(bytes);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = unix_->RegisterCudaVmmRegion(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    return st.error_message();
  };
  EXPECT_TRUE(StartsWith(refused({2 << 20, 0}, 0, 64), "chunks[1]: must be > 0"));
  EXPECT_TRUE(StartsWith(refused({2 << 20}, 8, 64), "offset: 8 is not a multiple of 16"));
  EXPECT_TRUE(StartsWith(refused({2 << 20}, 2 << 20, 64), "offset: 2097152 is past the end"));
  EXPECT_TRUE(
      StartsWith(refused({2 << 20, 2 << 20}, 16, 4 << 20), "byte_size: offset 16 + 4194304"));
  EXPECT_TRUE(StartsWith(refused({2 << 20}, 0, 0), "byte_size: must be > 0"));
  ExpectServing();
}

}  // namespace
}  // namespace verifyd::testing
