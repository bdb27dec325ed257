#pragma once
// A Verify call whose request goes out as its pieces (SerializeRequestAround): q and the pool are
// sent from the caller's memory, with no copy into the message and none into a serialized buffer;
// gRPC writes them to the socket from where they are. The call declares the request's size in
// its metadata (src/transport/request_bytes.h).

#include <memory>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "src/bundle/request_in_place.h"
#include "verifyd/v1/verify.grpc.pb.h"  // protobuf serialization for gRPC

namespace verifyd::cli {

// One per thread: calls are made one at a time, each blocking as the generated stub's do.
class PiecesCaller {
 public:
  explicit PiecesCaller(std::shared_ptr<grpc::Channel> channel);
  ~PiecesCaller();
  PiecesCaller(const PiecesCaller&) = delete;
  PiecesCaller& operator=(const PiecesCaller&) = delete;

  // The pieces' memory must stay valid until this returns.
  grpc::Status Verify(grpc::ClientContext* ctx, const RequestPieces& req, v1::VerifyResponse* resp);

 private:
  grpc::TemplatedGenericStub<grpc::ByteBuffer, v1::VerifyResponse> stub_;
  grpc::CompletionQueue cq_;
};

}  // namespace verifyd::cli
