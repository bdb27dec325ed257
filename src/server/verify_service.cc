#include "src/server/verify_service.h"

#include <string>

namespace verifyd {

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

grpc::Status VerifyServiceImpl::Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* req,
                                       v1::VerifyResponse* resp) {
  const CallContext call([ctx] { return ctx->IsCancelled(); }, ctx->deadline());
  return ToGrpc(handler_->Handle(*req, resp, call));
}

grpc::Status VerifyServiceImpl::VerifyStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::VerifyResponse, v1::VerifyRequest>* stream) {
  v1::VerifyRequest req;
  while (stream->Read(&req)) {
    v1::VerifyResponse resp;
    absl::Status st = handler_->Handle(req, &resp);
    if (!st.ok()) {
      resp.Clear();
      resp.set_request_id(req.request_id());
      resp.set_error_code(static_cast<int>(st.code()));
      resp.set_error_message(std::string(st.message()));
    }
    if (!stream->Write(resp)) break;
    if (ctx->IsCancelled()) break;
  }
  return grpc::Status::OK;
}

}  // namespace verifyd
