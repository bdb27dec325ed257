#include "src/server/region_rpcs.h"

#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/server/proto_convert.h"
#include "src/transport/unix_socket_acceptor.h"

namespace verifyd {
namespace {

bool NamesRegion(const v1::Tensor& t) {
  return t.contents_case() == v1::Tensor::kShm || t.contents_case() == v1::Tensor::kCudaIpc;
}

}  // namespace

absl::Status LocalTransportOnly(const grpc::ServerContext& ctx, bool allow_tcp, const char* what) {
  // Every Unix-socket connection is accepted by verifyd and handed to gRPC, which names its
  // peer "fd:N" (UnixSocketAcceptor); that is how the caller's uid is known (RegisterShm).
  const std::string peer = ctx.peer();
  if (allow_tcp || absl::StartsWith(peer, "fd:")) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what,
      ": shared-memory and CUDA IPC regions are served on Unix sockets only, and so are call "
      "channels (this call came from ",
      peer,
      "): connect to verifyd's Unix socket (verifyd --listen=unix:PATH, client "
      "--target=unix:PATH), where the kernel tells verifyd who the caller is"));
}

Peer CallerOf(const grpc::ServerContext& ctx, const std::string& client) {
  const std::string peer = ctx.peer();
  if (!absl::StartsWith(peer, "fd:")) return Peer::Tcp(client);
  const std::optional<uint32_t> uid = UnixPeerUid(peer);
  if (!uid) {
    Peer nobody;  // the kernel did not say who it is: it may use nothing
    nobody.label = "an unverified Unix-socket peer";
    return nobody;
  }
  return Peer::Unix(*uid, UnixPeerPid(peer));
}

absl::Status RegionRpcs::CheckTransport(const grpc::ServerContext& ctx, const char* what) const {
  if (regions_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": this verifyd serves no regions (--max_regions=0)"));
  }
  return LocalTransportOnly(ctx, allow_tcp_, what);
}

absl::Status RegionRpcs::RegisterShm(const grpc::ServerContext& ctx,
                                     const v1::RegisterShmRegionRequest& req,
                                     v1::RegisterRegionResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "RegisterShmRegion"); !st.ok()) return st;
  // On a Unix socket the kernel says who is asking, and only that uid's objects are mapped;
  // over TCP (--allow_region_tcp) nobody is known and the operator has vouched for the callers.
  absl::StatusOr<RegionSummary> s =
      regions_->RegisterShm(req.name(), req.key(), req.offset(), req.byte_size(), req.client(),
                            CallerOf(ctx, req.client()));
  if (!s.ok()) return s.status();
  ToProto(*s, resp->mutable_region());
  return absl::OkStatus();
}

absl::Status RegionRpcs::RegisterShmSet(const grpc::ServerContext& ctx,
                                        const v1::RegisterShmRegionSetRequest& req,
                                        v1::RegisterRegionSetResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "RegisterShmRegionSet"); !st.ok()) return st;
  std::vector<ShmSetMember> members;
  members.reserve(req.members_size());
  for (const v1::ShmRegionSetMember& m : req.members()) {
    members.push_back({m.key(), m.offset(), m.byte_size()});
  }
  absl::StatusOr<RegionSetSummary> s =
      regions_->RegisterShmSet(req.name(), members, req.client(), CallerOf(ctx, req.client()));
  if (!s.ok()) return s.status();
  ToProto(*s, resp->mutable_set());
  return absl::OkStatus();
}

absl::Status RegionRpcs::RegisterCuda(const grpc::ServerContext& ctx,
                                      const v1::RegisterCudaRegionRequest& req,
                                      v1::RegisterRegionResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "RegisterCudaRegion"); !st.ok()) return st;
  absl::StatusOr<RegionSummary> s =
      regions_->RegisterCuda(req.name(), req.ipc_handle(), req.device(), req.byte_size(),
                             req.client(), CallerOf(ctx, req.client()));
  if (!s.ok()) return s.status();
  ToProto(*s, resp->mutable_region());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<UniqueFd>> RegionRpcs::TakeFds(const grpc::ServerContext& ctx,
                                                          const std::string& token) const {
  if (vmm_fds_ == nullptr) {
    return absl::FailedPreconditionError(
        "token: this verifyd has no descriptor socket (it opens one next to each Unix data "
        "socket: --listen=unix:PATH serves PATH.fds)");
  }
  const std::optional<uint32_t> uid = UnixPeerUid(ctx.peer());
  if (!uid) {
    return absl::PermissionDeniedError(
        "token: descriptors are given only to the uid that sent them, which verifyd knows on its "
        "Unix socket only; register VMM allocations there");
  }
  if (token.size() != kVmmTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("token: ", token.size(), " bytes, expected ", kVmmTokenBytes));
  }
  return vmm_fds_->Take(token, *uid);
}

absl::Status RegionRpcs::RegisterCudaVmm(const grpc::ServerContext& ctx,
                                         const v1::RegisterCudaVmmRegionRequest& req,
                                         v1::RegisterRegionResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "RegisterCudaVmmRegion"); !st.ok()) return st;
  absl::StatusOr<std::vector<UniqueFd>> fds = TakeFds(ctx, req.token());
  if (!fds.ok()) return fds.status();
  std::vector<int> borrowed;
  borrowed.reserve(fds->size());
  for (const UniqueFd& fd : *fds) borrowed.push_back(fd.get());
  const std::vector<uint64_t> chunks(req.chunks().begin(), req.chunks().end());
  // The descriptors close when this returns: an imported chunk holds its memory without them.
  absl::StatusOr<RegionSummary> s =
      regions_->RegisterCudaVmm(req.name(), borrowed, chunks, req.device(), req.offset(),
                                req.byte_size(), req.client(), CallerOf(ctx, req.client()));
  if (!s.ok()) return s.status();
  ToProto(*s, resp->mutable_region());
  return absl::OkStatus();
}

absl::Status RegionRpcs::RegisterCudaSet(const grpc::ServerContext& ctx,
                                         const v1::RegisterCudaRegionSetRequest& req,
                                         v1::RegisterRegionSetResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "RegisterCudaRegionSet"); !st.ok()) return st;
  std::vector<CudaSetMember> members(req.members_size());
  size_t chunks = 0;
  for (int i = 0; i < req.members_size(); ++i) {
    const v1::CudaRegionSetMember& m = req.members(i);
    members[i].ipc_handle = m.ipc_handle();
    members[i].chunk_bytes.assign(m.chunks().begin(), m.chunks().end());
    members[i].offset = m.offset();
    members[i].byte_size = m.byte_size();
    chunks += m.chunks_size();
  }
  // The descriptors close when this returns: an imported chunk holds its memory without them.
  std::vector<UniqueFd> fds;
  if (chunks > 0 || !req.token().empty()) {
    absl::StatusOr<std::vector<UniqueFd>> taken = TakeFds(ctx, req.token());
    if (!taken.ok()) return taken.status();
    fds = std::move(*taken);
    if (fds.size() != chunks) {
      return absl::InvalidArgumentError(
          absl::StrCat("token: ", fds.size(),
                       " descriptors were sent under it, the members' "
                       "chunks add up to ",
                       chunks, " (one descriptor a chunk, member by member, in order)"));
    }
  }
  size_t next = 0;
  for (CudaSetMember& m : members) {
    for (size_t c = 0; c < m.chunk_bytes.size(); ++c) m.fds.push_back(fds[next++].get());
  }
  absl::StatusOr<RegionSetSummary> s = regions_->RegisterCudaSet(
      req.name(), members, req.device(), req.client(), CallerOf(ctx, req.client()));
  if (!s.ok()) return s.status();
  ToProto(*s, resp->mutable_set());
  return absl::OkStatus();
}

absl::Status RegionRpcs::Unregister(const grpc::ServerContext& ctx,
                                    const v1::UnregisterRegionRequest& req,
                                    v1::UnregisterRegionResponse* resp) {
  if (absl::Status st = CheckTransport(ctx, "UnregisterRegion"); !st.ok()) return st;
  absl::StatusOr<std::vector<std::string>> names =
      regions_->Unregister(req.name(), req.client(), CallerOf(ctx, req.client()));
  if (!names.ok()) return names.status();
  for (const std::string& n : *names) resp->add_unregistered(n);
  return absl::OkStatus();
}

absl::Status RegionRpcs::List(const grpc::ServerContext& ctx, v1::ListRegionsResponse* resp) {
  // Listing shows no memory: served on every transport, each caller the regions it may use (the
  // operator sees them all in verifyctl status). The counts are the daemon's.
  if (regions_ == nullptr) return absl::OkStatus();
  const Peer caller = CallerOf(ctx, "");
  for (const RegionSummary& s : regions_->List(&caller)) ToProto(s, resp->add_regions());
  for (const RegionSetSummary& s : regions_->ListSets(&caller)) ToProto(s, resp->add_sets());
  resp->set_total_bytes(regions_->total_bytes());
  resp->set_region_count(regions_->count());
  resp->set_max_regions(regions_->limits().max_regions);
  resp->set_max_regions_per_client(regions_->limits().max_regions_per_client);
  resp->set_max_total_bytes(regions_->limits().max_total_bytes);
  resp->set_max_regions_per_uid(regions_->limits().max_regions_per_uid);
  if (caller.uid) resp->set_uid_region_count(regions_->count_of_uid(*caller.uid));
  resp->set_region_sharing(SharingName(regions_->limits().sharing));
  return absl::OkStatus();
}

absl::Status RegionRpcs::CheckRequest(const grpc::ServerContext& ctx,
                                      const v1::VerifyRequest& req) const {
  const v1::Tensor* fields[] = {&req.q(),          &req.kv_pool(), &req.kv_indptr(),
                                &req.kv_indices(), &req.kv_lens(), &req.tree_mask(),
                                &req.o_out(),      &req.lse_out()};
  const char* names[] = {"q",       "kv_pool",   "kv_indptr", "kv_indices",
                         "kv_lens", "tree_mask", "o_out",     "lse_out"};
  for (size_t i = 0; i < std::size(fields); ++i) {
    if (NamesRegion(*fields[i])) return CheckTransport(ctx, names[i]);
  }
  return absl::OkStatus();
}

}  // namespace verifyd
