#pragma once
// The data plane's gRPC streams, unary Verify calls included: a synchronous gRPC server gives
// each open stream, and each Verify call from its headers on, a thread of its own, so callers
// that send headers and nothing else could take every thread. The limiter
//   - keeps the streams below a ceiling under the thread count (the rest serve unary calls), and
//     each peer below its share of them (--grpc_max_streams_per_peer);
//   - keeps each peer's Verify calls that wait for their message below a share
//     (--grpc_max_waiting_calls_per_peer); calls being served are bounded by the memory budget;
//   - cancels a stream that has sent nothing for the idle timeout, and a Verify call whose
//     message has not arrived within the body timeout (--request_body_timeout_ms), whatever the
//     client's own deadline, so that what it holds (a thread, a declared size's budget) goes.
// A refusal is RESOURCE_EXHAUSTED, at once, naming the flag. A peer is what ShareKey() says:
// a uid on a Unix socket (all its processes), the host over TCP.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace verifyd {

struct StreamLimits {
  int max_streams = 96;                 // open at once; 0 = none served
  int max_streams_per_peer = 64;        // of those, from one peer (the others keep a third)
  int max_waiting_calls_per_peer = 16;  // Verify calls from one peer awaiting their message
  absl::Duration idle_timeout = absl::Minutes(5);  // since the last message; zero = never
  absl::Duration body_timeout = absl::Seconds(5);  // a Verify call's message; zero = never
};

// Who a share is counted for: "uid 1000" for a Unix-socket peer ("fd:N"), the host without the
// port over TCP ("ipv4:10.0.0.7").
std::string ShareKey(const std::string& grpc_peer);

class StreamLimiter {
 public:
  // `refused(resource, reason)`: each refusal and cancellation (metrics); may be null.
  using Refused = std::function<void(const char* resource, const char* reason)>;
  explicit StreamLimiter(StreamLimits limits, Refused refused = nullptr);
  ~StreamLimiter();
  StreamLimiter(const StreamLimiter&) = delete;
  StreamLimiter& operator=(const StreamLimiter&) = delete;

  // Registers a stream that just opened; RESOURCE_EXHAUSTED naming the limit when it is reached.
  absl::Status Open(grpc::ServerContext* ctx);
  void Touch(grpc::ServerContext* ctx);  // a message arrived on it
  void Close(grpc::ServerContext* ctx);  // before the stream's handler returns

  // A unary Verify call whose headers arrived: RESOURCE_EXHAUSTED when the peer has its share of
  // calls waiting for their message already; else its message must arrive (Arrived) within the
  // body timeout or the call is cancelled.
  absl::Status BeginCall(grpc::ServerContext* ctx);
  void Arrived(grpc::ServerContext* ctx);  // its message was read
  void EndCall(grpc::ServerContext* ctx);  // before the call's handler returns

  int open() const;
  int64_t idle_cancelled() const;
  int64_t body_cancelled() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Open_ {
    std::string peer;
    Clock::time_point last;  // streams: the last message; calls: the body's deadline
    bool call = false;       // a unary call (else a stream)
    bool cancelled = false;
  };
  void Reap();
  // The entries of `peer` of one kind, under mu_.
  int CountLocked(const std::string& peer, bool call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StreamLimits limits_;
  const Refused refused_;
  mutable absl::Mutex mu_;
  std::map<grpc::ServerContext*, Open_> open_ ABSL_GUARDED_BY(mu_);
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t idle_cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t body_cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace verifyd
