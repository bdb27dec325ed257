#include "src/server/verify_service.h"

#include <chrono>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/support/method_handler.h"
#include "src/common/seconds_since.h"
#include "src/server/proto_convert.h"
#include "src/transport/in_band_error.h"
#include "src/transport/request_bytes.h"
#include "src/transport/unix_socket_acceptor.h"
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

constexpr char kNotARequest[] = "message could not be parsed as a verifyd.v1.VerifyRequest";

// The request size a unary call declared in its metadata (kRequestBytesKey); nullopt when it did
// not. Only decimal digits are a size: anything else, or the key given twice, is refused.
absl::StatusOr<std::optional<int64_t>> DeclaredBytes(const grpc::ServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  const auto [first, end] = md.equal_range(kRequestBytesKey);
  if (first == end) return std::nullopt;
  if (std::next(first) != end) {
    return absl::InvalidArgumentError(
        absl::StrCat(kRequestBytesKey, ": given more than once; send one request size"));
  }
  const absl::string_view v(first->second.data(), first->second.size());
  const auto refuse = [v](absl::string_view why) {
    constexpr size_t kShown = 40;
    return absl::InvalidArgumentError(absl::StrCat(kRequestBytesKey, ": '", v.substr(0, kShown),
                                                   v.size() > kShown ? "..." : "", "' ", why));
  };
  if (v.empty()) return refuse("is not a request size in bytes (decimal digits)");
  int64_t n = 0;
  for (const char c : v) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return refuse("is not a request size in bytes (decimal digits)");
    }
    if (n > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10) {
      return refuse("is out of range");
    }
    n = n * 10 + (c - '0');
  }
  return n;
}

}  // namespace

VerifyServiceImpl::VerifyServiceImpl(VerifyHandler* handler, Metrics* metrics,
                                     VerifyServiceOptions opts)
    : handler_(handler),
      metrics_(metrics),
      opts_(opts),
      region_rpcs_(opts.regions, opts.allow_region_tcp),
      budget_(
          opts.max_inflight_bytes, "--max_inflight_mb",
          [this](int64_t peak) { trimmer_.Idle(peak); }, opts.inflight_peer_share),
      trimmer_(opts.heap_trim, [this] { return budget_.in_flight() == 0; }),
      receive_(opts.receive_keep_bytes, opts.pin_host),
      streams_(opts.streams,
               [metrics](const char* resource, const char* reason) {
                 metrics->TenancyRefusal(resource, reason);
               }),
      verify_method_(MethodName("Verify")),
      stream_method_(MethodName("VerifyStream")),
      channels_(
          opts.channels,
          [this](const Peer& owner, absl::string_view r, v1::VerifyResponse* resp) {
            ServeChannelCall(owner, r, resp);
          },
          [this](const Peer& owner, const absl::StatusOr<v1::VerifyRequest>& call,
                 const v1::VerifyRequest* d, uint64_t layout_key,
                 v1::VerifyResponse* resp) { ServeDoorbellCall(owner, call, d, layout_key, resp); },
          opts.pin_host) {
  channels_.SetTapServer(this);
  channels_.SetSwitchServer(this);
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
      "RegisterShmRegion",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::RegisterShmRegionRequest& req,
         v1::RegisterRegionResponse* resp) {
        return s->region_rpcs_.RegisterShm(*ctx, req, resp);
      });
  AddUnary<v1::RegisterCudaRegionRequest, v1::RegisterRegionResponse>(
      "RegisterCudaRegion",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::RegisterCudaRegionRequest& req,
         v1::RegisterRegionResponse* resp) {
        return s->region_rpcs_.RegisterCuda(*ctx, req, resp);
      });
  region_rpcs_.SetVmmFds(opts.vmm_fds);
  AddUnary<v1::RegisterCudaVmmRegionRequest, v1::RegisterRegionResponse>(
      "RegisterCudaVmmRegion",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
         const v1::RegisterCudaVmmRegionRequest& req, v1::RegisterRegionResponse* resp) {
        return s->region_rpcs_.RegisterCudaVmm(*ctx, req, resp);
      });
  AddUnary<v1::RegisterShmRegionSetRequest, v1::RegisterRegionSetResponse>(
      "RegisterShmRegionSet",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::RegisterShmRegionSetRequest& req,
         v1::RegisterRegionSetResponse* resp) {
        return s->region_rpcs_.RegisterShmSet(*ctx, req, resp);
      });
  AddUnary<v1::RegisterCudaRegionSetRequest, v1::RegisterRegionSetResponse>(
      "RegisterCudaRegionSet",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx,
         const v1::RegisterCudaRegionSetRequest& req, v1::RegisterRegionSetResponse* resp) {
        return s->region_rpcs_.RegisterCudaSet(*ctx, req, resp);
      });
  AddUnary<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      "UnregisterRegion",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::UnregisterRegionRequest& req,
         v1::UnregisterRegionResponse* resp) {
        return s->region_rpcs_.Unregister(*ctx, req, resp);
      });
  AddUnary<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      "ListRegions",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::ListRegionsRequest&,
         v1::ListRegionsResponse* resp) { return s->region_rpcs_.List(*ctx, resp); });
  AddUnary<v1::OpenChannelRequest, v1::OpenChannelResponse>(
      "OpenChannel",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::OpenChannelRequest& req,
         v1::OpenChannelResponse* resp) { return s->OpenChannel(*ctx, req, resp); });
  AddUnary<v1::CloseChannelRequest, v1::CloseChannelResponse>(
      "CloseChannel",
      [](VerifyServiceImpl* s, grpc::ServerContext* ctx, const v1::CloseChannelRequest& req,
         v1::CloseChannelResponse* resp) { return s->CloseChannel(*ctx, req, resp); });
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

absl::Status VerifyServiceImpl::Admit(int64_t bytes, MemoryBudget::Admission* admitted,
                                      const std::string& peer) {
  if (bytes > opts_.max_message_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("message of ", bytes, " bytes exceeds the limit of ",
                     opts_.max_message_bytes >> 20, " MiB (--max_message_mb)"));
  }
  absl::StatusOr<MemoryBudget::Admission> a = budget_.Admit(bytes, peer);
  if (!a.ok()) {
    if (!peer.empty() && a.status().message().find("share") != absl::string_view::npos) {
      metrics_->TenancyRefusal("budget", "peer_share");
    }
    return a.status();
  }
  *admitted = std::move(*a);
  return absl::OkStatus();
}

CallContext::Hold VerifyServiceImpl::HoldFor(std::string peer) {
  return [this, peer = std::move(peer)](int64_t bytes) -> absl::StatusOr<std::shared_ptr<void>> {
    MemoryBudget::Admission a;
    if (absl::Status st = Admit(bytes, &a, peer); !st.ok()) return st;
    return std::shared_ptr<void>(std::make_shared<MemoryBudget::Admission>(std::move(a)));
  };
}

absl::Status VerifyServiceImpl::AdmitDeclared(const grpc::ServerContext& ctx,
                                              std::optional<int64_t>* declared,
                                              MemoryBudget::Admission* admitted) {
  absl::StatusOr<std::optional<int64_t>> d = DeclaredBytes(ctx);
  if (!d.ok()) return d.status();
  *declared = *d;
  if (!declared->has_value()) return absl::OkStatus();
  absl::Status st = Admit(**declared, admitted, ShareKey(ctx.peer()));
  if (!st.ok()) {
    return absl::Status(st.code(), absl::StrCat(kRequestBytesKey, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status VerifyServiceImpl::Parse(absl::string_view wire, v1::VerifyRequest* req,
                                      InPlaceTensors* in_place) {
  if (!ParseRequestInPlace(wire, req, in_place)) {
    req->Clear();
    return absl::InvalidArgumentError(kNotARequest);
  }
  return absl::OkStatus();
}

absl::Status VerifyServiceImpl::Handle(absl::Status read, std::chrono::steady_clock::time_point t0,
                                       double parse_s, const v1::VerifyRequest& req,
                                       v1::VerifyResponse* resp, const CallContext& call,
                                       const InPlaceTensors* in_place, uint64_t layout_key) {
  if (!read.ok()) {
    metrics_->Request("none", read.code(), Since(t0));
    return read;
  }
  absl::Status st = handler_->Handle(req, resp, call, in_place, layout_key);
  if (st.ok()) resp->mutable_timing()->set_parse_seconds(parse_s);
  return st;
}

absl::Status VerifyServiceImpl::Serve(grpc::ServerContext* ctx, Raw& in,
                                      std::optional<int64_t> declared,
                                      MemoryBudget::Admission* admitted, v1::VerifyRequest* req,
                                      v1::VerifyResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t size = static_cast<int64_t>(in.Length());
  absl::Status st;
  if (!declared) {
    st = Admit(size, admitted, ShareKey(ctx->peer()));
  } else if (size > *declared) {
    st = absl::InvalidArgumentError(absl::StrCat(kRequestBytesKey, ": the message has ", size,
                                                 " bytes, more than the ", *declared,
                                                 " it declared"));
  } else {
    admitted->ShrinkTo(size);  // what the message holds; the rest goes back at once
  }
  // The message's bytes stay in `received` until the handler is done with them.
  absl::StatusOr<ReceiveBuffers::Message> received;
  InPlaceTensors in_place;
  if (st.ok()) {
    received = receive_.Receive(in);
    st = received.ok() ? Parse(received->bytes(), req, &in_place) : received.status();
  }
  in.Clear();
  const double parse_s = Since(t0);
  if (st.ok()) st = region_rpcs_.CheckRequest(*ctx, *req);
  CallContext call([ctx] { return ctx->IsCancelled(); }, ctx->deadline(), CallerOf(*ctx, ""));
  call.set_hold(HoldFor(ShareKey(ctx->peer())));
  return Handle(st, t0, parse_s, *req, resp, call, &in_place);
}

void VerifyServiceImpl::ServeChannelCall(const Peer& owner, absl::string_view request,
                                         v1::VerifyResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  MemoryBudget::Admission admitted;
  v1::VerifyRequest req;
  InPlaceTensors in_place;
  absl::Status st = Admit(static_cast<int64_t>(request.size()), &admitted, UidShareKey(owner));
  if (st.ok()) st = Parse(request, &req, &in_place);
  // The channel was opened over a transport regions are served on: its calls may name the
  // regions its owner may.
  CallContext call(owner);
  call.set_hold(HoldFor(UidShareKey(owner)));
  st = Handle(st, t0, Since(t0), req, resp, call, &in_place);
  if (!st.ok()) ErrorInResponse(st, req.request_id(), resp);
}

void VerifyServiceImpl::ServeDoorbellCall(const Peer& owner,
                                          const absl::StatusOr<v1::VerifyRequest>& call,
                                          const v1::VerifyRequest* descriptor, uint64_t layout_key,
                                          v1::VerifyResponse* resp) {
  const auto t0 = std::chrono::steady_clock::now();
  // No bytes arrive with the call (its tensors are in regions): nothing to admit or parse.
  const v1::VerifyRequest& req = call.ok() ? *call : v1::VerifyRequest::default_instance();
  CallContext ctx(owner);
  ctx.set_hold(HoldFor(UidShareKey(owner)));
  absl::Status st = Handle(call.status(), t0, 0, req, resp, ctx, nullptr, layout_key);
  if (st.ok()) return;
  ErrorInResponse(st, req.request_id(), resp);
  if (descriptor != nullptr) handler_->ZeroOutputs(*descriptor, owner);
}

absl::StatusOr<TapOpen> VerifyServiceImpl::PlanTapChannel(const v1::OpenChannelRequest& req,
                                                          const Peer& caller) const {
  absl::StatusOr<channel::Geometry> g =
      channel::GeometryFor(req.byte_size(), channels_.limits().max_capacity);
  if (!g.ok()) return g.status();
  absl::StatusOr<channel::TapPlan> plan = channel::PlanTap(req.tap(), g->capacity);
  if (!plan.ok()) return plan.status();
  if (opts_.regions == nullptr) {
    return absl::FailedPreconditionError("tap.region: this verifyd serves no regions");
  }
  const std::string& name = req.tap().region();
  std::vector<RegionPin> pins;
  const uint64_t at = req.tap().region_offset();
  absl::StatusOr<RegionRange> r = opts_.regions->Resolve("tap.region", RegionKind::kCudaIpc, name,
                                                         at, plan->region_bytes, &pins, caller);
  if (absl::IsNotFound(r.status())) {
    r = opts_.regions->Resolve("tap.region", RegionKind::kShm, name, at, plan->region_bytes, &pins,
                               caller);
    plan->shm_region = true;
  }
  if (!r.ok()) {
    return absl::Status(
        r.status().code(),
        absl::StrCat(r.status().message(), " (the tap's control block and ", req.tap().slots(),
                     " slots need ", plan->region_bytes, " bytes)"));
  }
  if (!plan->shm_region && r->device() != req.tap().device()) {
    return absl::InvalidArgumentError(absl::StrCat("tap.device: ", req.tap().device(),
                                                   ", but region '", name, "' is on device ",
                                                   r->device()));
  }
  TapOpen open{*plan, {}};
  for (uint32_t s = 0; s < plan->spec.slots(); ++s) {
    open.slot_calls.push_back(channel::TapSlotCall(*plan, s, plan->shm_region));
  }
  return open;
}

TapResult VerifyServiceImpl::Serve(const std::string& channel, const Peer& owner,
                                   const channel::TapPlan& plan,
                                   const absl::StatusOr<v1::VerifyRequest>& call) {
  (void)channel;
  const std::string& backend = plan.spec.backend();
  TapResult r;
  if (call.ok()) {
    r = handler_->ServeTap(*call, backend, owner);
  } else {
    r.error = call.status().ToString();
  }
  if (!r.compared) metrics_->TapEvents(backend, "refused", 1);
  return r;
}

absl::Status VerifyServiceImpl::WriteControl(const Peer& owner, const channel::TapPlan& plan,
                                             uint64_t offset, const void* src, uint64_t bytes) {
  return handler_->WriteRegion(owner, plan.shm_region ? RegionKind::kShm : RegionKind::kCudaIpc,
                               plan.spec.region(), plan.spec.region_offset() + offset, src, bytes);
}

channel::SwitchDirective VerifyServiceImpl::Directive() {
  const auto [mode, fraction] = handler_->ServingMode();
  channel::SwitchDirective d;
  if (mode == Mode::kCustom) {
    d.path = channel::SwitchPath::kOp;
  } else if (mode == Mode::kCanary) {
    d.path = channel::SwitchPath::kCanary;
    d.canary_fraction = fraction;
  }
  return d;
}

void VerifyServiceImpl::StepCounts(const std::string& model, int64_t op_steps, int64_t stack_steps,
                                   int64_t lease_expired) {
  metrics_->SwitchSteps(model, "op", op_steps);
  metrics_->SwitchSteps(model, "stack", stack_steps);
  metrics_->SwitchLeaseExpired(model, lease_expired);
}

void VerifyServiceImpl::GpuCounts(const std::string& backend, int64_t calls, int64_t taps,
                                  int64_t dropped) {
  metrics_->TapEvents(backend, "calls", calls);
  metrics_->TapEvents(backend, "taps", taps);
  metrics_->TapEvents(backend, "dropped", dropped);
}

absl::Status VerifyServiceImpl::OpenChannel(const grpc::ServerContext& ctx,
                                            const v1::OpenChannelRequest& req,
                                            v1::OpenChannelResponse* resp) {
  if (absl::Status st = LocalTransportOnly(ctx, opts_.allow_region_tcp, "OpenChannel"); !st.ok()) {
    return st;
  }
  const Peer caller = CallerOf(ctx, req.client());
  std::optional<TapOpen> tap;
  if (req.has_tap()) {
    absl::StatusOr<TapOpen> t = PlanTapChannel(req, caller);
    if (!t.ok()) return t.status();
    tap = std::move(*t);
  }
  absl::StatusOr<ChannelSummary> s = channels_.Open(
      req.name(), req.key(), req.byte_size(), req.client(), caller, req.descriptors(),
      req.layout_slots(), tap, req.has_serving_switch() ? &req.serving_switch() : nullptr,
      opts_.kernel_build);
  if (!s.ok()) return s.status();
  if (tap) {
    const tap::TapSlotGeometry& tg = tap->plan.geometry;
    resp->set_tap_region_bytes(tap->plan.region_bytes);
    resp->set_tap_slot_offset(tg.SlotOffset(0));
    resp->set_tap_slot_bytes(tg.slot_bytes);
    resp->set_tap_o_offset(tg.o_offset);
    resp->set_tap_kv_offset(tg.kv_offset);
    resp->set_tap_record_bytes(static_cast<uint32_t>(tg.record_bytes));
    resp->set_tap_mask_row_bytes(static_cast<uint32_t>(tg.mask_row_bytes));
  }
  resp->set_capacity(s->geometry.capacity);
  resp->set_request_offset(s->geometry.request_offset);
  resp->set_response_offset(s->geometry.response_offset);
  if (s->descriptors > 0) {
    resp->set_layout_slot_bytes(s->plan.slot_bytes);
    resp->set_layout_slots(s->plan.slots);
    resp->set_max_batch(static_cast<uint32_t>(s->plan.max_batch));
  }
  return absl::OkStatus();
}

absl::Status VerifyServiceImpl::CloseChannel(const grpc::ServerContext& ctx,
                                             const v1::CloseChannelRequest& req,
                                             v1::CloseChannelResponse* resp) {
  if (absl::Status st = LocalTransportOnly(ctx, opts_.allow_region_tcp, "CloseChannel"); !st.ok()) {
    return st;
  }
  absl::StatusOr<std::vector<std::string>> names =
      channels_.Close(req.name(), req.client(), CallerOf(ctx, req.client()));
  if (!names.ok()) return names.status();
  for (const std::string& n : *names) resp->add_closed(n);
  return absl::OkStatus();
}

grpc::Status VerifyServiceImpl::Verify(grpc::ServerContext* ctx, RawUnary* call) {
  // A declared size is judged before the message is received: a call that cannot be admitted is
  // refused without its bytes being read. The call holds a thread (and its declaration's budget)
  // until its message arrives: no longer than the body timeout, and no more calls than the
  // peer's share.
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status st = streams_.BeginCall(ctx); !st.ok()) {
    metrics_->Request("none", st.code(), Since(t0));
    return ToGrpc(st);
  }
  struct Ender {
    StreamLimiter& limiter;
    grpc::ServerContext* ctx;
    ~Ender() { limiter.EndCall(ctx); }
  } ender{streams_, ctx};
  std::optional<int64_t> declared;
  MemoryBudget::Admission admitted;
  if (absl::Status st = AdmitDeclared(*ctx, &declared, &admitted); !st.ok()) {
    metrics_->Request("none", st.code(), Since(t0));
    return ToGrpc(st);
  }
  Raw in;
  if (!call->Read(&in)) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "no request message arrived (cancelled, or not within "
                        "--request_body_timeout_ms)");
  }
  streams_.Arrived(ctx);
  v1::VerifyRequest req;
  v1::VerifyResponse resp;
  if (absl::Status st = Serve(ctx, in, declared, &admitted, &req, &resp); !st.ok()) {
    return ToGrpc(st);
  }
  Raw out;
  if (grpc::Status st = Serialize(resp, &out); !st.ok()) return st;
  call->Write(out);
  return grpc::Status::OK;
}

grpc::Status VerifyServiceImpl::VerifyStream(grpc::ServerContext* ctx, RawStream* stream) {
  if (absl::Status st = streams_.Open(ctx); !st.ok()) return ToGrpc(st);
  struct Closer {
    StreamLimiter& limiter;
    grpc::ServerContext* ctx;
    ~Closer() { limiter.Close(ctx); }
  } closer{streams_, ctx};
  Raw in;
  while (stream->Read(&in)) {
    streams_.Touch(ctx);
    MemoryBudget::Admission admitted;
    v1::VerifyRequest req;
    v1::VerifyResponse resp;
    absl::Status st = Serve(ctx, in, std::nullopt, &admitted, &req, &resp);
    if (!st.ok()) ErrorInResponse(st, req.request_id(), &resp);
    Raw out;
    if (!Serialize(resp, &out).ok() || !stream->Write(out)) break;
    if (ctx->IsCancelled()) break;
    streams_.Touch(ctx);
  }
  return grpc::Status::OK;
}

}  // namespace verifyd
