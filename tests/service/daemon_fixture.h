#pragma once
// An in-process verifyd on port 0 and a Unix socket, with clients for both services.

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "grpc/grpc.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/daemon/daemon.h"
#include "verifyd/v1/admin.grpc.pb.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd::testing {

inline constexpr int64_t kMiB = int64_t{1} << 20;

inline std::string TestDir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::path(::testing::TempDir()) /
             ("vd_" + tag + "_" + info->test_suite_name() + "_" + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// The engine under test: the CPU engine by default; VERIFYD_TEST_ENGINE=cuda runs the same suites
// against the CUDA engine on a GPU machine.
inline std::string TestEngine() {
  const char* e = std::getenv("VERIFYD_TEST_ENGINE");
  return e && *e ? e : "cpu";
}

// A separate engine of the same kind, for computing what a path outputs.
inline std::unique_ptr<Engine> LocalEngine() {
  EngineOptions o;
  o.kind = TestEngine();
  o.cpu_threads = 2;
  o.cuda_pool_bytes = int64_t{2} << 30;
  auto e = MakeEngine(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

// Runs test `filter` of this test binary in a child process, with VERIFYD_CHILD_TARGET set to
// `target` (the daemon the child calls); returns what it printed, its exit status in `*status`.
inline std::string RunChildTest(const std::string& target, const std::string& filter, int* status) {
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd =
      "VERIFYD_CHILD_TARGET=" + target + " '" + exe + "' --gtest_filter=" + filter + " 2>&1";
  FILE* child = ::popen(cmd.c_str(), "r");
  std::string out;
  if (child == nullptr) {
    *status = -1;
    return out;
  }
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, child)) > 0;) out.append(buf, n);
  *status = ::pclose(child);
  return out;
}

inline DaemonOptions TestOptions(const std::string& dir) {
  DaemonOptions o;
  o.listen = {"127.0.0.1:0", "unix:" + dir + "/data.sock"};
  o.admin_listen = "unix:" + dir + "/admin.sock";
  o.metrics_address = "127.0.0.1:0";
  o.state_dir = dir + "/state";
  o.engine.kind = TestEngine();
  o.engine.cuda_pool_bytes = int64_t{2} << 30;
  o.engine.cpu_threads = 2;
  o.controller.gate_window = 3;
  return o;
}

// gRPC stays initialized until the test process exits, as in verifyd's main(): otherwise the
// destructor of a test's last gRPC object makes the last grpc_shutdown(), which joins gRPC's
// executor threads, and one of them can sit in a poll for about 10 s.
inline void KeepGrpcInitialized() {
  static const bool kept = (grpc_init(), true);
  (void)kept;
}

inline std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
  KeepGrpcInitialized();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT32_MAX);
  args.SetMaxSendMessageSize(INT32_MAX);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// A small valid request.
inline v1::VerifyRequest SmallRequest(uint64_t seed, int draft = 3, int64_t prefix = 54,
                                      int page_size = 16) {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = draft;
  spec.heads = 8;
  spec.prefix = prefix;
  spec.page_size = page_size;
  spec.seed = seed;
  RandomBundle b(spec);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  return req;
}

// The bytes a path produces for `req`, computed in-process by a separate engine.
inline std::string LocalOutput(const v1::VerifyRequest& req, Path path) {
  auto view = DecodeRequest(req);
  EXPECT_TRUE(view.ok()) << view.status();
  auto engine = LocalEngine();
  auto prepared = engine->Prepare(*view, false);
  EXPECT_TRUE(prepared.ok());
  EXPECT_TRUE(engine->Run(path, **prepared).ok());
  PathOutput out;
  EXPECT_TRUE(engine->Fetch(path, **prepared, &out).ok());
  return std::string(reinterpret_cast<const char*>(out.o.data()), out.o.size() * 2);
}

// The value of an unlabelled series in a /metrics text; -1 when it is not there.
inline double MetricValue(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

// One unary call of `method` with raw bytes, as any client could send them; waits for its status.
inline grpc::Status RawUnaryCall(const std::string& target, const std::string& method,
                                 grpc::ByteBuffer* req, grpc::ByteBuffer* resp) {
  grpc::GenericStub generic(Channel(target));
  grpc::ClientContext ctx;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, method, grpc::StubOptions(), req, resp, [&](grpc::Status s) {
    std::lock_guard<std::mutex> l(mu);
    status = s;
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return done; });
  return status;
}

inline std::string Scrape(int port) {
  httplib::Client cli("127.0.0.1", port);
  auto res = cli.Get("/metrics");
  return res && res->status == 200 ? res->body : std::string();
}

class DaemonTest : public ::testing::Test {
 protected:
  void StartDaemon(DaemonOptions o) {
    KeepGrpcInitialized();
    auto d = Daemon::Start(std::move(o));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    tcp_ = daemon_->listen_addresses()[0];
    verify_ = v1::VerifyService::NewStub(Channel(tcp_));
    admin_ = v1::AdminService::NewStub(Channel(daemon_->admin_address()));
  }
  grpc::Status Verify(const v1::VerifyRequest& req, v1::VerifyResponse* resp) {
    grpc::ClientContext ctx;
    return verify_->Verify(&ctx, req, resp);
  }
  grpc::Status SetMode(v1::Mode m, bool force, double fraction = 0) {
    v1::SetModeRequest req;
    req.set_mode(m);
    req.set_force(force);
    req.set_canary_fraction(fraction);
    req.set_reason("test");
    v1::SetModeResponse resp;
    grpc::ClientContext ctx;
    return admin_->SetMode(&ctx, req, &resp);
  }
  v1::GetStatusResponse Status() {
    v1::GetStatusResponse s;
    grpc::ClientContext ctx;
    EXPECT_TRUE(admin_->GetStatus(&ctx, v1::GetStatusRequest(), &s).ok());
    return s;
  }
  // Waits (at most 5 s) until no call channel is open; returns how many still are.
  int AwaitNoChannels() {
    int open = -1;
    for (int i = 0; i < 100 && open != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      open = Status().channels_size();
    }
    return open;
  }
  // Waits (at most 30 s) until the comparisons of `n` calls have been recorded.
  v1::Counters WaitForComparisons(int64_t n) {
    v1::Counters c;
    for (int i = 0; i < 600; ++i) {
      c = Status().counters();
      if (c.comparisons_match() + c.comparisons_breach() + c.comparisons_error() +
              c.comparisons_skipped() >=
          n) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return c;
  }
  std::unique_ptr<Daemon> daemon_;
  std::string tcp_;
  std::unique_ptr<v1::VerifyService::Stub> verify_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

}  // namespace verifyd::testing
