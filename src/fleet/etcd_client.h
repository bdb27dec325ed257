#pragma once
// What talks to etcd's v3 gRPC API (proto/etcd/) in both directions of a fleet: the endpoints
// list, the channel, and a small synchronous key-value client. The node's source
// (etcd_source.h) and the rollout controller (`verifyctl fleet`) share them.
//
// The connection is plain gRPC without TLS or authentication: for an etcd on loopback or on a
// cluster-internal network only.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace grpc {
class Channel;
class Status;
}  // namespace grpc

namespace verifyd::fleet {

// "host:port[,host:port...]": INVALID_ARGUMENT naming `field` for an empty list or an entry
// without a port.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list,
                                                            absl::string_view field = "fleet_etcd");

// A channel to one endpoint that reconnects within a second of etcd coming back (gRPC's default
// backoff grows to minutes) and notices a dead peer on an idle watch by keepalive pings (etcd
// permits one per 5 s).
std::shared_ptr<grpc::Channel> MakeEtcdChannel(const std::string& endpoint);

// A gRPC failure as an absl::Status with the same code: "what: message".
absl::Status FromGrpc(const grpc::Status& st, absl::string_view what);

struct EtcdValue {
  std::string key;
  std::string value;
  int64_t mod_revision = 0;
};

// Unary Range and Txn calls, each tried on every endpoint in turn until one answers.
class EtcdKv {
 public:
  explicit EtcdKv(std::vector<std::string> endpoints,
                  absl::Duration rpc_timeout = absl::Seconds(2));
  ~EtcdKv();

  // The key's value; nullopt when it does not exist.
  absl::StatusOr<std::optional<EtcdValue>> Get(const std::string& key);
  // Every key under `prefix`, in key order.
  absl::StatusOr<std::vector<EtcdValue>> List(const std::string& prefix);
  // Puts `value` if the key's mod revision is still `mod_revision` (0: the key does not exist);
  // ABORTED when another writer came first.
  absl::Status PutIfUnchanged(const std::string& key, const std::string& value,
                              int64_t mod_revision);
  // "host:port[,host:port...]", the endpoints as given.
  std::string Describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace verifyd::fleet
