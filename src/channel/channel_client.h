#pragma once
// The client side of a call channel (verify.proto, OpenChannel): a POSIX shared-memory object
// this process creates and owns, opened with verifyd, then one call at a time through it with no
// gRPC round trip. Not thread-safe: one channel per thread that calls.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "src/channel/channel_layout.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd::channel {

struct ChannelClientOptions {
  std::string name;                        // the channel's name at verifyd; unique there
  uint64_t byte_size = uint64_t{8} << 20;  // header + two areas
  std::string client;                      // groups channels for CloseChannel
  // How long Call() spins for the answer before it sleeps on the futex: an answer within it
  // costs no wake-up.
  absl::Duration spin = absl::Milliseconds(2);
};

class ChannelClient {
 public:
  // Makes the context of each control RPC (OpenChannel, CloseChannel): deadline, credentials.
  using ContextFactory = std::function<std::unique_ptr<grpc::ClientContext>()>;

  // Creates the object (named after this process and `o.name`, mode 0600), opens it through
  // `stub`. The error of OpenChannel comes back as it is.
  static absl::StatusOr<std::unique_ptr<ChannelClient>> Open(v1::VerifyService::Stub& stub,
                                                             ContextFactory make_context,
                                                             ChannelClientOptions o);
  ~ChannelClient();  // closes the channel, unmaps and unlinks the object
  ChannelClient(const ChannelClient&) = delete;
  ChannelClient& operator=(const ChannelClient&) = delete;

  // One call. OK with `resp` filled when verifyd answered (a failed call carries its error in
  // resp->error_code and error_message, as on the stream); otherwise the channel failed:
  // RESOURCE_EXHAUSTED for a request larger than the area, UNAVAILABLE when verifyd closed the
  // channel, DEADLINE_EXCEEDED past `deadline` (the channel is then unusable: an answer may
  // still come).
  absl::Status Call(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                    absl::Time deadline = absl::InfiniteFuture());
  uint32_t capacity() const { return geometry_.capacity; }
  const std::string& key() const { return key_; }

 private:
  ChannelClient(v1::VerifyService::Stub& stub, ContextFactory make_context, ChannelClientOptions o)
      : stub_(stub), make_context_(std::move(make_context)), opts_(std::move(o)) {}
  absl::Status Create();

  v1::VerifyService::Stub& stub_;
  ContextFactory make_context_;
  ChannelClientOptions opts_;
  std::string key_;
  char* base_ = nullptr;
  Geometry geometry_;
  uint32_t seq_ = 0;
  bool open_ = false;
  absl::Status broken_;  // not OK once a call was abandoned
};

}  // namespace verifyd::channel
