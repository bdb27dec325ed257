#include "src/server/verify_service.h"

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/method_handler.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd {
namespace {

using Raw = grpc::ByteBuffer;
using RawStream = grpc::ServerReaderWriter<Raw, Raw>;
using RawUnary = grpc::ServerUnaryStreamer<Raw, Raw>;

std::string MethodName(const char* method) {
  return absl::StrCat("/", v1::VerifyService::service_full_name(), "/", method);
}

grpc::Status Serialize(const v1::VerifyResponse& resp, Raw* out) {
  bool own_buffer = false;
  return grpc::SerializationTraits<v1::VerifyResponse>::Serialize(resp, out, &own_buffer);
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

VerifyServiceImpl::VerifyServiceImpl(VerifyHandler* handler, Metrics* metrics,
                                     VerifyServiceOptions opts)
    : handler_(handler),
      metrics_(metrics),
      opts_(opts),
      region_rpcs_(opts.regions, opts.allow_region_tcp),
      budget_(opts.max_inflight_bytes, "--max_inflight_mb"),
      verify_method_(MethodName("Verify")),
      stream_method_(MethodName("VerifyStream")) {
  // The unary call reads its message itself (a streamed unary handler is, to the server, a
  // stream of one message each way), so that its wire bytes go once they are parsed.
  AddMethod(new grpc::internal::RpcServiceMethod(
      verify_method_.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING,
      new grpc::internal::StreamedUnaryHandler<Raw, Raw>(
          [this](grpc::ServerContext* ctx, RawUnary* call) { return Verify(ctx, call); })));
  AddMethod(new grpc::internal::RpcServiceMethod(
      stream_method_.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING,
      new grpc::internal::BidiStreamingHandler<VerifyServiceImpl, Raw, Raw>(
          [](VerifyServiceImpl* s, grpc::ServerContext* ctx, RawStream* stream) {
            return s->VerifyStream(ctx, stream);
          },
          this)));
  AddUnary<v1::RegisterShmRegionRequest, v1::RegisterRegionResponse>(
      "RegisterShmRegion", [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
                              const v1::RegisterShmRegionRequest& req,
                              v1::RegisterRegionResponse* resp) {
        return s->region_rpcs_.RegisterShm(*ctx, req, resp);
      });
  AddUnary<v1::RegisterCudaRegionRequest, v1::RegisterRegionResponse>(
      "RegisterCudaRegion", [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
                               const v1::RegisterCudaRegionRequest& req,
                               v1::RegisterRegionResponse* resp) {
        return s->region_rpcs_.RegisterCuda(*ctx, req, resp);
      });
  AddUnary<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      "UnregisterRegion", [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
                             const v1::UnregisterRegionRequest& req,
                             v1::UnregisterRegionResponse* resp) {
        return s->region_rpcs_.Unregister(*ctx, req, resp);
      });
  AddUnary<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      "ListRegions", [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
                        const v1::ListRegionsRequest&, v1::ListRegionsResponse* resp) {
        return s->region_rpcs_.List(*ctx, resp);
      });
}

template <typename Req, typename Resp>
void VerifyServiceImpl::AddUnary(const char* method,
                                 absl::Status (*fn)(VerifyServiceImpl*, grpc::ServerContext*,
                                                    const Req&, Resp*)) {
  const char* name = method_names_.emplace_back(MethodName(method)).c_str();
  AddMethod(new grpc::internal::RpcServiceMethod(
      name, grpc::internal::RpcMethod::NORMAL_RPC,
      new grpc::internal::RpcMethodHandler<VerifyServiceImpl, Req, Resp>(
          [fn](VerifyServiceImpl* s, grpc::ServerContext* ctx, const Req* req, Resp* resp) {
            return ToGrpc(fn(s, ctx, *req, resp));
          },
          this)));
}

absl::Status VerifyServiceImpl::Admit(Raw& in, MemoryBudget::Admission* admitted) {
  const int64_t bytes = static_cast<int64_t>(in.Length());
  if (bytes > opts_.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("message of ", bytes, " bytes exceeds the limit of ",
                     opts_.max_message_bytes >> 20, " MiB (--max_message_mb)"));
  }
  absl::StatusOr<MemoryBudget::Admission> a = budget_.Admit(bytes);
  if (!a.ok()) return a.status();
  *admitted = std::move(*a);
  return absl::OkStatus();
}

absl::Status VerifyServiceImpl::Parse(Raw& in, v1::VerifyRequest* req) {
  // Deserialize consumes the buffer: the wire bytes are freed once parsed.
  if (!grpc::SerializationTraits<v1::VerifyRequest>::Deserialize(&in, req).ok()) {
    req->Clear();
    return absl::InvalidArgumentError("message could not be parsed as a verifyd.v1.VerifyRequest");
  }
  return absl::OkStatus();
}

absl::Status VerifyServiceImpl::Serve(grpc::ServerContext* ctx, Raw& in,
                                      MemoryBudget::Admission* admitted, v1::VerifyRequest* req,
                                      v1::VerifyResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = Admit(in, admitted);
  if (st.ok()) st = Parse(in, req);
  const double parse_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st.ok()) {
    in.Clear();
    metrics_->Request(
        "none", st.code(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return st;
  }
  if (st = region_rpcs_.CheckRequest(*ctx, *req); !st.ok()) {
    metrics_->Request(
        "none", st.code(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return st;
  }
  const CallContext call([ctx] { return ctx->IsCancelled(); }, ctx->deadline());
  st = handler_->Handle(*req, resp, call);
  if (st.ok()) resp->mutable_timing()->set_parse_seconds(parse_s);
  return st;
}

grpc::Status VerifyServiceImpl::Verify(grpc::ServerContext* ctx, RawUnary* call) {
  Raw in;
  if (!call->Read(&in)) return grpc::Status(grpc::StatusCode::INTERNAL, "no request message");
  MemoryBudget::Admission admitted;
  v1::VerifyRequest req;
  v1::VerifyResponse resp;
  if (absl::Status st = Serve(ctx, in, &admitted, &req, &resp); !st.ok()) return ToGrpc(st);
  Raw out;
  if (grpc::Status st = Serialize(resp, &out); !st.ok()) return st;
  call->Write(out);
  return grpc::Status::OK;
}

grpc::Status VerifyServiceImpl::VerifyStream(grpc::ServerContext* ctx, RawStream* stream) {
  Raw in;
  while (stream->Read(&in)) {
    MemoryBudget::Admission admitted;
    v1::VerifyRequest req;
    v1::VerifyResponse resp;
    absl::Status st = Serve(ctx, in, &admitted, &req, &resp);
    if (!st.ok()) {
      resp.Clear();
      resp.set_request_id(req.request_id());
      resp.set_error_code(static_cast<int>(st.code()));
      resp.set_error_message(std::string(st.message()));
    }
    Raw out;
    if (!Serialize(resp, &out).ok() || !stream->Write(out)) break;
    if (ctx->IsCancelled()) break;
  }
  return grpc::Status::OK;
}

}  // namespace verifyd
