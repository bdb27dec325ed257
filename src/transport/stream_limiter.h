#pragma once
// The data plane's streams: a synchronous gRPC server gives each open stream a thread of its own,
// so streams that never send could take every thread from the unary calls. The limiter keeps a
// ceiling below the thread count (a stream beyond it is refused at once), and cancels a stream
// that has sent nothing for the idle timeout.

#include <chrono>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace verifyd {

struct StreamLimits {
  int max_streams = 96;                            // open at once; 0 = none served
  absl::Duration idle_timeout = absl::Minutes(5);  // since the last message; zero = never
};

class StreamLimiter {
 public:
  explicit StreamLimiter(StreamLimits limits);
  ~StreamLimiter();
  StreamLimiter(const StreamLimiter&) = delete;
  StreamLimiter& operator=(const StreamLimiter&) = delete;

  // Registers a stream that just opened; RESOURCE_EXHAUSTED naming the limit when it is reached.
  absl::Status Open(grpc::ServerContext* ctx);
  void Touch(grpc::ServerContext* ctx);  // a message arrived on it
  void Close(grpc::ServerContext* ctx);  // before the stream's handler returns
  int open() const;
  int64_t idle_cancelled() const;

 private:
  using Clock = std::chrono::steady_clock;
  void Reap();

  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  std::map<grpc::ServerContext*, Clock::time_point> last_ ABSL_GUARDED_BY(mu_);
  int64_t idle_cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace verifyd
