#pragma once
// The region RPCs of verifyd.v1.VerifyService (RegisterShmRegion, RegisterShmRegionSet,
// RegisterCudaRegion, RegisterCudaVmmRegion, RegisterCudaRegionSet, UnregisterRegion,
// ListRegions) over the region registry, and the rule for
// where regions are served: on Unix sockets, and over TCP only with --allow_region_tcp. A region is
// memory on the daemon's host; a peer on another host could not have registered it, and one that
// names it over TCP reads and writes the daemon's memory through a transport that does not say who
// it is.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "src/common/peer.h"
#include "src/region/region_registry.h"
#include "src/transport/vmm_fd_inbox.h"
#include "verifyd/v1/admin.pb.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

// OK when the call came over a Unix socket (whose peer verifyd knows: UnixSocketAcceptor), or
// `allow_tcp` (--allow_region_tcp); PERMISSION_DENIED naming `what` otherwise. Regions and call
// channels are served only there.
absl::Status LocalTransportOnly(const grpc::ServerContext& ctx, bool allow_tcp, const char* what);

// Who calls (src/common/peer.h): on a Unix socket the peer credentials the kernel gave verifyd
// ("uid 1000 pid 4242": a process cannot claim another's); over TCP (--allow_region_tcp, which
// vouches for every TCP caller) one TCP tenant, labelled by the client name the request carries
// ("tcp client 'NAME'"), which --max_regions_per_client counts by.
Peer CallerOf(const grpc::ServerContext& ctx, const std::string& client);

class RegionRpcs {
 public:
  // `regions` null: every region RPC and region tensor is refused (FAILED_PRECONDITION).
  RegionRpcs(RegionRegistry* regions, bool allow_tcp) : regions_(regions), allow_tcp_(allow_tcp) {}
  // Where RegisterCudaVmm takes the descriptors clients sent (null: no descriptor socket, and the
  // call is refused). Set before serving.
  void SetVmmFds(VmmFdInbox* inbox) { vmm_fds_ = inbox; }

  absl::Status RegisterShm(const grpc::ServerContext& ctx, const v1::RegisterShmRegionRequest& req,
                           v1::RegisterRegionResponse* resp);
  absl::Status RegisterCuda(const grpc::ServerContext& ctx,
                            const v1::RegisterCudaRegionRequest& req,
                            v1::RegisterRegionResponse* resp);
  // Takes the descriptors sent under the request's token by the caller's uid, then registers
  // them as RegionRegistry::RegisterCudaVmm does.
  absl::Status RegisterCudaVmm(const grpc::ServerContext& ctx,
                               const v1::RegisterCudaVmmRegionRequest& req,
                               v1::RegisterRegionResponse* resp);
  absl::Status RegisterShmSet(const grpc::ServerContext& ctx,
                              const v1::RegisterShmRegionSetRequest& req,
                              v1::RegisterRegionSetResponse* resp);
  // Takes the descriptors of the VMM members' chunks (when any member is VMM) as RegisterCudaVmm
  // does, hands each member its own, then registers the set as
  // RegionRegistry::RegisterCudaSet does.
  absl::Status RegisterCudaSet(const grpc::ServerContext& ctx,
                               const v1::RegisterCudaRegionSetRequest& req,
                               v1::RegisterRegionSetResponse* resp);
  absl::Status Unregister(const grpc::ServerContext& ctx, const v1::UnregisterRegionRequest& req,
                          v1::UnregisterRegionResponse* resp);
  absl::Status List(const grpc::ServerContext& ctx, v1::ListRegionsResponse* resp);

  // OK when `req` names no region, or the call came over a transport regions are served on.
  absl::Status CheckRequest(const grpc::ServerContext& ctx, const v1::VerifyRequest& req) const;

 private:
  absl::Status CheckTransport(const grpc::ServerContext& ctx, const char* what) const;
  // The descriptors the caller's uid sent under `token` (RegisterCudaVmm's checks).
  absl::StatusOr<std::vector<UniqueFd>> TakeFds(const grpc::ServerContext& ctx,
                                                const std::string& token) const;

  RegionRegistry* regions_;
  bool allow_tcp_;
  VmmFdInbox* vmm_fds_ = nullptr;
};

}  // namespace verifyd
