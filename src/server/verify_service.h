#pragma once
// verifyd.v1.VerifyService over gRPC: the unary call and the bidirectional stream. Messages
// arrive as raw bytes and are parsed here, so that a message that cannot be parsed, one over the
// size limit or one that does not fit the memory budget gets a clear error (in band on the
// stream, which goes on) and is counted. A unary call that declares its size in its metadata
// (src/transport/request_bytes.h) is admitted to the budget, or refused, before its message is
// received; any other message is admitted once it has arrived. gRPC's wire bytes are freed once
// copied into a receive buffer (ReceiveBuffers), where the message is parsed in place and stays
// until its call ends. When the calls in flight drop back to none after a large burst, the heap
// gives its freed memory back to the system (HeapTrimmer).

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "src/channel/channel_server.h"
#include "src/metrics/metrics.h"
#include "src/server/region_rpcs.h"
#include "src/server/verify_handler.h"
#include "src/transport/heap_trimmer.h"
#include "src/transport/memory_budget.h"
#include "src/transport/receive_buffers.h"
#include "src/transport/stream_limiter.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

struct VerifyServiceOptions {
  int64_t max_message_bytes = int64_t{2} << 30;  // 1 GiB bundles with room; larger: refused
  // Requests in flight hold at most this many message bytes together; <= 0: no ceiling.
  int64_t max_inflight_bytes = int64_t{8} << 30;
  RegionRegistry* regions = nullptr;  // null: no regions
  // The descriptors clients sent on the descriptor socket (RegisterCudaVmmRegion); null: none.
  VmmFdInbox* vmm_fds = nullptr;
  // Pins host memory for the engine (channels' areas); null: nothing is pinned.
  RegionRegistry::HostPinner pin_host;
  bool allow_region_tcp = false;  // --allow_region_tcp (channels too)
  ChannelLimits channels;
  // The build a switch channel's kernel library must come from (verifyd's commit).
  std::string kernel_build;
  // Notified at each change of the mode (switch channels renew at once); null: none.
  const ChangeSignal* mode_changes = nullptr;
  // Receive buffers kept (and pinned) between calls, bytes (--pinned_receive_mb).
  uint64_t receive_keep_bytes = uint64_t{1} << 30;
  // --grpc_max_streams(_per_peer), --grpc_max_waiting_calls_per_peer, --stream_idle_timeout_s,
  // --request_body_timeout_ms
  StreamLimits streams;
  // The part of max_inflight_bytes one peer may hold (--max_inflight_peer_share).
  double inflight_peer_share = 0.5;
  // Returning freed heap memory after a burst (HeapTrimmer); after_bytes <= 0: never.
  HeapTrimmer::Options heap_trim;
};

class VerifyServiceImpl final : public grpc::Service, private TapServer, private SwitchServer {
 public:
  VerifyServiceImpl(VerifyHandler* handler, Metrics* metrics, VerifyServiceOptions opts);
  ChannelServer& channels() { return channels_; }
  ReceiveBuffers& receive_buffers() { return receive_; }
  const MemoryBudget& budget() const { return budget_; }
  const StreamLimiter& streams() const { return streams_; }
  const HeapTrimmer& trimmer() const { return trimmer_; }

  grpc::Status Verify(grpc::ServerContext* ctx,
                      grpc::ServerUnaryStreamer<grpc::ByteBuffer, grpc::ByteBuffer>* call);
  // A bad message gets its error in the response (error_code, error_message); the stream goes on.
  grpc::Status VerifyStream(grpc::ServerContext* ctx,
                            grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream);

 private:
  // Admits `in` to the memory budget (held in `admitted` until the response is sent), receives
  // it into one of `receive_`'s buffers, parses it there in place and runs the handler. With a
  // `declared` size, `admitted` already holds it: a larger message is refused, a smaller one
  // gives the difference back. A message refused before the handler saw it is counted here
  // (path "none").
  absl::Status Serve(grpc::ServerContext* ctx, grpc::ByteBuffer& in,
                     std::optional<int64_t> declared, MemoryBudget::Admission* admitted,
                     v1::VerifyRequest* req, v1::VerifyResponse* resp);
  // One call from a channel: its serialized request, in the channel's area, parsed in place
  // (ParseRequestInPlace); errors in the response's error_code and error_message, as on the
  // stream.
  void ServeChannelCall(const Peer& owner, absl::string_view request, v1::VerifyResponse* resp);
  // A doorbell channel's call (ChannelServer::ServeBuilt): served as a Verify call; on an error
  // the descriptor's outputs are zero-filled.
  void ServeDoorbellCall(const Peer& owner, const absl::StatusOr<v1::VerifyRequest>& call,
                         const v1::VerifyRequest* descriptor, uint64_t layout_key,
                         v1::VerifyResponse* resp);
  // What every call does once its message is read: a message refused before the handler saw it
  // (`read`, not OK) is counted here (path "none"); otherwise the handler runs it.
  absl::Status Handle(absl::Status read, std::chrono::steady_clock::time_point t0, double parse_s,
                      const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                      const CallContext& call, const InPlaceTensors* in_place = nullptr,
                      uint64_t layout_key = 0);
  // `peer`: whose share of the budget it counts against (ShareKey; empty: none).
  absl::Status Admit(int64_t bytes, MemoryBudget::Admission* admitted, const std::string& peer);
  // CallContext::HoldBytes for a call of `peer`: Admit() into a handle that holds the bytes.
  CallContext::Hold HoldFor(std::string peer);
  // The size a unary call declared in its metadata (`declared`, nullopt when none), admitted like
  // a message of that size: INVALID_ARGUMENT for a malformed declaration, RESOURCE_EXHAUSTED
  // when it does not fit; both name the key.
  absl::Status AdmitDeclared(const grpc::ServerContext& ctx, std::optional<int64_t>* declared,
                             MemoryBudget::Admission* admitted);
  // ParseRequestInPlace, with its refusal as the status.
  static absl::Status Parse(absl::string_view wire, v1::VerifyRequest* req,
                            InPlaceTensors* in_place);
  absl::Status OpenChannel(const grpc::ServerContext& ctx, const v1::OpenChannelRequest& req,
                           v1::OpenChannelResponse* resp);
  // A tap channel's plan and slot calls: PlanTap against the channel's request area, and its
  // slots region registered (shm or cuda_ipc), large enough and on the spec's device.
  // The region is one `caller` may use.
  absl::StatusOr<TapOpen> PlanTapChannel(const v1::OpenChannelRequest& req,
                                         const Peer& caller) const;
  // TapServer: tap channels' fills go to the handler (ServeTap).
  TapResult Serve(const std::string& channel, const Peer& owner, const channel::TapPlan& plan,
                  const absl::StatusOr<v1::VerifyRequest>& call) override;
  absl::Status WriteControl(const Peer& owner, const channel::TapPlan& plan, uint64_t offset,
                            const void* src, uint64_t bytes) override;
  double SampleRate() override { return handler_->TapSampleRate(); }
  void GpuCounts(const std::string& backend, int64_t calls, int64_t taps, int64_t dropped) override;
  // SwitchServer: switch channels follow the mode (shadow and reference: the stack; canary: its
  // fraction; custom: the op) and report their steps to the metrics.
  channel::SwitchDirective Directive() override;
  const ChangeSignal* DirectiveChanges() override { return opts_.mode_changes; }
  void StepCounts(const std::string& model, int64_t op_steps, int64_t stack_steps,
                  int64_t lease_expired) override;
  absl::Status CloseChannel(const grpc::ServerContext& ctx, const v1::CloseChannelRequest& req,
                            v1::CloseChannelResponse* resp);

  // Adds a unary method whose typed request and response go to `fn`.
  template <typename Req, typename Resp>
  void AddUnary(const char* method,
                absl::Status (*fn)(VerifyServiceImpl*, grpc::ServerContext*, const Req&, Resp*));

  VerifyHandler* handler_;
  Metrics* metrics_;
  VerifyServiceOptions opts_;
  RegionRpcs region_rpcs_;
  std::deque<std::string> method_names_;  // stable: the names gRPC's method table points at
  MemoryBudget budget_;
  HeapTrimmer trimmer_;  // told by budget_ when no call is in flight; asks budget_ back
  ReceiveBuffers receive_;
  StreamLimiter streams_;
  const std::string verify_method_, stream_method_;
  ChannelServer channels_;  // last: its threads call into the members above
};

}  // namespace verifyd
