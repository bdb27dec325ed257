#include "src/fleet/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "etcdserverpb/rpc.grpc.pb.h"

namespace verifyd::fleet {

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list,
                                                            absl::string_view field) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',')) {
    e = absl::StripAsciiWhitespace(e);
    if (e.empty()) continue;
    const size_t colon = e.rfind(':');
    if (colon == absl::string_view::npos || colon == 0 || colon + 1 == e.size()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": '", e, "' is not host:port"));
    }
    out.emplace_back(e);
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": no endpoint given"));
  return out;
}

std::shared_ptr<grpc::Channel> MakeEtcdChannel(const std::string& endpoint) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  return grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpc(const grpc::Status& st, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                      absl::StrCat(what, ": ", st.error_message()));
}

struct EtcdKv::Impl {
  std::vector<std::string> endpoints;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  absl::Duration rpc_timeout;
  size_t current = 0;

  // Runs `call` on the endpoint in use, then on the others in turn while they are unavailable.
  absl::Status Call(
      absl::string_view what,
      const std::function<grpc::Status(etcdserverpb::KV::Stub&, grpc::ClientContext&)>& call) {
    absl::Status last = absl::UnavailableError("no etcd endpoint");
    for (size_t tried = 0; tried < channels.size(); ++tried) {
      auto stub = etcdserverpb::KV::NewStub(channels[current]);
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout));
      const grpc::Status st = call(*stub, ctx);
      if (st.ok()) return absl::OkStatus();
      last = FromGrpc(st, absl::StrCat("etcd ", endpoints[current], " ", what));
      if (st.error_code() != grpc::StatusCode::UNAVAILABLE &&
          st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        return last;
      }
      // A fresh channel for the next call: one whose connection was lost may keep failing its
      // attempts after the endpoint is back.
      channels[current] = MakeEtcdChannel(endpoints[current]);
      current = (current + 1) % channels.size();
    }
    return last;
  }
};

EtcdKv::EtcdKv(std::vector<std::string> endpoints, absl::Duration rpc_timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->endpoints = std::move(endpoints);
  impl_->rpc_timeout = rpc_timeout;
  for (const std::string& e : impl_->endpoints) impl_->channels.push_back(MakeEtcdChannel(e));
}

EtcdKv::~EtcdKv() = default;

absl::StatusOr<std::optional<EtcdValue>> EtcdKv::Get(const std::string& key) {
  etcdserverpb::RangeRequest req;
  etcdserverpb::RangeResponse resp;
  req.set_key(key);
  absl::Status st = impl_->Call("range", [&](etcdserverpb::KV::Stub& kv, grpc::ClientContext& c) {
    return kv.Range(&c, req, &resp);
  });
  if (!st.ok()) return st;
  if (resp.kvs().empty()) return std::optional<EtcdValue>();
  const mvccpb::KeyValue& kv = resp.kvs(0);
  return std::optional<EtcdValue>(EtcdValue{kv.key(), kv.value(), kv.mod_revision()});
}

absl::StatusOr<std::vector<EtcdValue>> EtcdKv::List(const std::string& prefix) {
  etcdserverpb::RangeRequest req;
  etcdserverpb::RangeResponse resp;
  req.set_key(prefix);
  // range_end: the prefix with its last byte incremented (every key that starts with it).
  std::string end = prefix;
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) {
    end.assign(1, '\0');
  } else {
    end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  }
  req.set_range_end(end);  // etcd answers in key order
  absl::Status st = impl_->Call("range", [&](etcdserverpb::KV::Stub& kv, grpc::ClientContext& c) {
    return kv.Range(&c, req, &resp);
  });
  if (!st.ok()) return st;
  std::vector<EtcdValue> out;
  for (const mvccpb::KeyValue& kv : resp.kvs()) {
    out.push_back({kv.key(), kv.value(), kv.mod_revision()});
  }
  return out;
}

absl::Status EtcdKv::PutIfUnchanged(const std::string& key, const std::string& value,
                                    int64_t mod_revision) {
  etcdserverpb::TxnRequest req;
  etcdserverpb::TxnResponse resp;
  etcdserverpb::Compare* cmp = req.add_compare();
  cmp->set_key(key);
  cmp->set_target(etcdserverpb::Compare::MOD);
  cmp->set_result(etcdserverpb::Compare::EQUAL);
  cmp->set_mod_revision(mod_revision);
  etcdserverpb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  absl::Status st = impl_->Call("txn", [&](etcdserverpb::KV::Stub& kv, grpc::ClientContext& c) {
    return kv.Txn(&c, req, &resp);
  });
  if (!st.ok()) return st;
  if (!resp.succeeded()) {
    return absl::AbortedError(
        absl::StrCat(key, " changed since it was read (another controller?); read it again"));
  }
  return absl::OkStatus();
}

std::string EtcdKv::Describe() const { return absl::StrJoin(impl_->endpoints, ","); }

}  // namespace verifyd::fleet
