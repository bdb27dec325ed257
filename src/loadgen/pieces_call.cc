#include "src/loadgen/pieces_call.h"

#include <vector>

#include "grpcpp/support/slice.h"
#include "src/transport/request_bytes.h"

namespace verifyd::cli {

PiecesCaller::PiecesCaller(std::shared_ptr<grpc::Channel> channel) : stub_(std::move(channel)) {}

PiecesCaller::~PiecesCaller() {
  cq_.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok)) {
  }
}

grpc::Status PiecesCaller::Verify(grpc::ClientContext* ctx, const RequestPieces& req,
                                  v1::VerifyResponse* resp) {
  std::vector<grpc::Slice> slices;
  for (absl::string_view p : req.Pieces()) {
    slices.emplace_back(p.data(), p.size(), grpc::Slice::STATIC_SLICE);  // not copied
  }
  grpc::ByteBuffer wire(slices.data(), slices.size());
  // The daemon admits the call, or refuses it, before the message is sent.
  DeclareRequestBytes(ctx, wire.Length());
  auto call = stub_.PrepareUnaryCall(ctx, "/verifyd.v1.VerifyService/Verify", wire, &cq_);
  call->StartCall();
  grpc::Status status;
  int done = 0;
  call->Finish(resp, &status, &done);
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok) && tag != &done) {
  }
  return status;
}

}  // namespace verifyd::cli
