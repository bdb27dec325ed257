#include "src/fleet/etcd_source.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "etcdserverpb/rpc.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace verifyd::fleet {
std::string NodeStatusJson(const std::string& node, const std::string& build,
                           const NodeState& state, const FollowerStatus& f,
                           const std::string& time) {
  nlohmann::json j = {
      {"node", node},
      {"mode", state.mode},
      {"canary_fraction", state.canary_fraction},
      {"gate", state.gate_open ? "open" : "closed"},
      {"gate_reason", state.gate_reason},
      {"source_up", f.source_up},
      {"source_error", f.source_error},
      {"generation_seen", f.generation_seen},
      {"generation_acted", f.generation_acted},
      {"in_step", f.in_step},
      {"last_outcome", f.last_outcome},
      {"last_detail", f.last_detail},
      {"build", build},
      {"time", time},
  };
  return j.dump();
}

EtcdSource::EtcdSource(EtcdOptions opts, FleetFollower* follower, NodeStateFn node_state)
    : opts_(std::move(opts)),
      prefix_(absl::StripSuffix(opts_.prefix, "/")),
      follower_(follower),
      node_state_(std::move(node_state)) {
  for (const std::string& e : opts_.endpoints) channels_.push_back(MakeEtcdChannel(e));
}

EtcdSource::~EtcdSource() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    for (grpc::ClientContext* c : calls_) c->TryCancel();
  }
  if (follower_thread_.joinable()) follower_thread_.join();
  if (report_thread_.joinable()) report_thread_.join();
  const int64_t lease = lease_id_.load();
  if (lease != 0 && !channels_.empty()) {
    // The key goes with its lease now rather than when the lease runs out.
    auto stub = etcdserverpb::Lease::NewStub(CurrentChannel());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    etcdserverpb::LeaseRevokeRequest req;
    etcdserverpb::LeaseRevokeResponse resp;
    req.set_id(lease);
    const grpc::Status st = stub->LeaseRevoke(&ctx, req, &resp);
    if (!st.ok())
      spdlog::warn("fleet: {}", std::string(FromGrpc(st, "etcd lease revoke").message()));
  }
}

void EtcdSource::Start() {
  follower_thread_ = std::thread([this] { Follow(); });
  report_thread_ = std::thread([this] { Reports(); });
}

void EtcdSource::ReportNow() {
  absl::MutexLock l(&mu_);
  report_asked_ = true;
}

std::string EtcdSource::Describe() const {
  const std::string& endpoint =
      opts_.endpoints.empty() ? "" : opts_.endpoints[current_.load() % opts_.endpoints.size()];
  return absl::StrCat("etcd ", endpoint, desired_key());
}

std::shared_ptr<grpc::Channel> EtcdSource::CurrentChannel() const {
  return channels_[current_.load() % channels_.size()];
}

bool EtcdSource::Register(grpc::ClientContext* ctx) {
  absl::MutexLock l(&mu_);
  if (stopping_) return false;
  calls_.push_back(ctx);
  return true;
}

void EtcdSource::Unregister(grpc::ClientContext* ctx) {
  absl::MutexLock l(&mu_);
  calls_.erase(std::remove(calls_.begin(), calls_.end(), ctx), calls_.end());
}

bool EtcdSource::Sleep(absl::Duration d, bool wake_on_report) {
  absl::MutexLock l(&mu_);
  auto done = [this, wake_on_report]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || (wake_on_report && report_asked_);
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), d);
  return stopping_;
}

void EtcdSource::Follow() {
  if (channels_.empty()) return;
  absl::Duration backoff = absl::Milliseconds(100);
  bool down = false;  // reported down, and not connected since
  for (;;) {
    bool connected = false;
    const absl::Status st = FollowOnce(CurrentChannel(), &connected);
    {
      absl::MutexLock l(&mu_);
      if (stopping_) return;
    }
    // A source down: the node keeps its mode; the follower logs and counts it. Told once per
    // loss, not at every failed attempt to connect again.
    if (connected || !down) {
      follower_->Consider(absl::UnavailableError(absl::StrCat(Describe(), ": ", st.message())));
      ReportNow();
      down = true;
    }
    if (connected) backoff = absl::Milliseconds(100);
    if (Sleep(backoff, false)) return;
    backoff = std::min(backoff * 2, opts_.max_backoff);
    current_ = (current_.load() + 1) % channels_.size();
  }
}

absl::Status EtcdSource::FollowOnce(const std::shared_ptr<grpc::Channel>& channel,
                                    bool* connected) {
  const std::string key = desired_key();
  int64_t revision = 0;
  {
    auto kv = etcdserverpb::KV::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
    if (!Register(&ctx)) return absl::CancelledError("stopping");
    etcdserverpb::RangeRequest req;
    etcdserverpb::RangeResponse resp;
    req.set_key(key);
    const grpc::Status st = kv->Range(&ctx, req, &resp);
    Unregister(&ctx);
    if (!st.ok()) return FromGrpc(st, "range");
    *connected = true;
    revision = resp.header().revision();
    if (resp.kvs().empty()) {
      follower_->Consider(absl::NotFoundError(absl::StrCat(Describe(), ": no such key")));
    } else {
      follower_->Consider(resp.kvs(0).value());
    }
    ReportNow();
  }
  auto watch = etcdserverpb::Watch::NewStub(channel);
  grpc::ClientContext ctx;
  if (!Register(&ctx)) return absl::CancelledError("stopping");
  auto stream = watch->Watch(&ctx);
  etcdserverpb::WatchRequest req;
  req.mutable_create_request()->set_key(key);
  req.mutable_create_request()->set_start_revision(revision + 1);
  absl::Status ended = absl::UnavailableError("watch: stream closed");
  bool cancel = true;  // unless the server ended the stream (Finish then says why)
  if (stream->Write(req)) {
    cancel = false;
    etcdserverpb::WatchResponse resp;
    while (stream->Read(&resp)) {
      if (resp.canceled()) {
        ended = absl::AbortedError(
            absl::StrCat("watch cancelled: ",
                         resp.compact_revision() > 0
                             ? absl::StrCat("revision compacted to ", resp.compact_revision())
                             : resp.cancel_reason()));
        cancel = true;
        break;
      }
      for (const mvccpb::Event& e : resp.events()) {
        if (e.kv().key() != key) continue;
        if (e.type() == mvccpb::Event::DELETE) {
          follower_->Consider(absl::NotFoundError(absl::StrCat(Describe(), ": key deleted")));
        } else {
          follower_->Consider(e.kv().value());
        }
        ReportNow();
      }
    }
  }
  if (cancel) ctx.TryCancel();
  const grpc::Status st = stream->Finish();
  Unregister(&ctx);
  if (!st.ok() && !cancel) return FromGrpc(st, "watch");
  return ended;
}

void EtcdSource::Reports() {
  if (channels_.empty()) return;
  for (;;) {
    {
      absl::MutexLock l(&mu_);
      report_asked_ = false;
    }
    const absl::Status st = ReportOnce();
    if (!st.ok()) spdlog::debug("fleet: status report to etcd: {}", std::string(st.message()));
    if (Sleep(opts_.report_period, true)) return;
  }
}

absl::Status EtcdSource::KeepLease(const std::shared_ptr<grpc::Channel>& channel) {
  auto lease = etcdserverpb::Lease::NewStub(channel);
  if (lease_id_.load() != 0) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
    if (!Register(&ctx)) return absl::CancelledError("stopping");
    auto stream = lease->LeaseKeepAlive(&ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    etcdserverpb::LeaseKeepAliveResponse resp;
    req.set_id(lease_id_.load());
    const bool answered = stream->Write(req) && stream->Read(&resp);
    stream->WritesDone();
    ctx.TryCancel();
    const grpc::Status st = stream->Finish();
    Unregister(&ctx);
    if (!answered) {
      return st.ok() ? absl::UnavailableError("lease keep-alive: no answer")
                     : FromGrpc(st, "lease keep-alive");
    }
    if (resp.ttl() > 0) return absl::OkStatus();
    lease_id_ = 0;  // expired (etcd was away longer than the TTL): a new one
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
  if (!Register(&ctx)) return absl::CancelledError("stopping");
  etcdserverpb::LeaseGrantRequest req;
  etcdserverpb::LeaseGrantResponse resp;
  req.set_ttl(opts_.lease_ttl_seconds);
  const grpc::Status st = lease->LeaseGrant(&ctx, req, &resp);
  Unregister(&ctx);
  if (!st.ok()) return FromGrpc(st, "lease grant");
  if (!resp.error().empty()) return absl::UnavailableError("lease grant: " + resp.error());
  lease_id_ = resp.id();
  return absl::OkStatus();
}

absl::Status EtcdSource::ReportOnce() {
  const std::shared_ptr<grpc::Channel> channel = CurrentChannel();
  if (absl::Status st = KeepLease(channel); !st.ok()) return st;
  const NodeState state = node_state_ ? node_state_() : NodeState{};
  const std::string json =
      NodeStatusJson(opts_.node, opts_.build, state, follower_->status(),
                     absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
  auto kv = etcdserverpb::KV::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
  if (!Register(&ctx)) return absl::CancelledError("stopping");
  etcdserverpb::PutRequest req;
  etcdserverpb::PutResponse resp;
  req.set_key(node_key());
  req.set_value(json);
  req.set_lease(lease_id_.load());
  const grpc::Status st = kv->Put(&ctx, req, &resp);
  Unregister(&ctx);
  if (!st.ok()) {
    if (st.error_code() == grpc::StatusCode::NOT_FOUND) lease_id_ = 0;  // lease not found
    return FromGrpc(st, "put");
  }
  return absl::OkStatus();
}

}  // namespace verifyd::fleet
