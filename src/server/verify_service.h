#pragma once
// verifyd.v1.VerifyService over gRPC: the unary call and the bidirectional stream.

#include "src/server/verify_handler.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd {

class VerifyServiceImpl final : public v1::VerifyService::Service {
 public:
  explicit VerifyServiceImpl(VerifyHandler* handler) : handler_(handler) {}

  grpc::Status Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* req,
                      v1::VerifyResponse* resp) override;
  // A bad message gets its error in the response (error_code, error_message); the stream goes on.
  grpc::Status VerifyStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::VerifyResponse, v1::VerifyRequest>* stream) override;

 private:
  VerifyHandler* handler_;
};

grpc::Status ToGrpc(const absl::Status& st);

}  // namespace verifyd
