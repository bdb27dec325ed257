#pragma once
// The registered regions (shared-memory extension): a client registers a region once and names
// byte ranges of it in every call. A region stays mapped until it is unregistered or verifyd
// stops. Each call that names it holds a RegionPin while it runs; unregistering removes the name
// at once (later calls get NOT_FOUND) and waits for the pinned calls to finish. The mapping goes
// when the last pin does.
//
// A region set is one registration of several allocations (e.g. a KV pool per layer) that calls
// name by (set, index): shm objects (RegisterShmSet) or CUDA allocations on one GPU, each a CUDA
// IPC or a VMM allocation (RegisterCudaSet). Each member is mapped and checked as a region of its
// own kind registered alone would be, and counts as one region against the limits; the set is
// registered whole or not at all, listed as one entry and unregistered as one.
//
// A region and a set belong to the peer that registered them (src/common/peer.h): what the
// transport verified about the caller ("uid 1000 pid 4242" from SO_PEERCRED on a Unix socket),
// not the client name the request carries, which anyone can choose. Another peer may use, list or
// unregister them only as --region_sharing allows (by default, the processes of the same uid);
// any other is refused PERMISSION_DENIED naming the region, and each refusal is reported to the
// denial observer (metrics, audit). When the registering process exits, its regions and sets are
// unregistered within about `reap_every` (a pidfd per process), as its channels are closed.
//
// The limits count regions daemon-wide (--max_regions), per registering process
// (--max_regions_per_client) and per uid (--max_regions_per_uid, so that no one user fills the
// daemon).

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/peer.h"
#include "src/common/process_watch.h"
#include "src/region/host_pinning.h"
#include "src/region/mapped_region.h"

namespace verifyd {

enum class RegionKind { kShm, kCudaIpc };

// Every range a call names, and every shm registration, starts on this many bytes: the widest
// load the engines make from a tensor in place (the CUDA kernel's 16-byte copies).
inline constexpr uint64_t kRegionAlign = 16;
const char* RegionKindName(RegionKind k);

struct RegionLimits {
  // Eight ranks of a DeepSeek-V3 / Kimi K2 server register a KV pool per layer: 8 x 61 = 488.
  int64_t max_regions = 1024;                          // --max_regions
  int64_t max_regions_per_client = 128;                // --max_regions_per_client (per process)
  int64_t max_regions_per_uid = 512;                   // --max_regions_per_uid
  uint64_t max_total_bytes = uint64_t{1} << 40;        // --max_region_mb (sum of byte_size)
  absl::Duration unregister_wait = absl::Seconds(30);  // how long an unregister waits for calls
  Sharing sharing = Sharing::kUid;                     // --region_sharing
  // How often the registering processes are looked at for their exit.
  absl::Duration reap_every = absl::Milliseconds(250);
};

struct RegionSummary {
  std::string name;
  RegionKind kind = RegionKind::kShm;
  std::string shm_key;
  uint64_t shm_offset = 0;
  int device = -1;
  uint64_t byte_size = 0;
  std::string client;
  std::string owner;  // the verified caller that registered it (Peer::label)
  int64_t in_use = 0;
  int64_t calls = 0;
  bool lost = false;  // MappedRegion::intact() went false
};

// One member of a region set to register.
struct ShmSetMember {
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

// One member of a CUDA region set to register: a CUDA IPC allocation (`ipc_handle`, its 64
// bytes) or the chunks of a VMM allocation (`fds`, one per chunk and borrowed, of `chunk_bytes`
// each), exactly one of the two. It starts `offset` bytes into the allocation (into the first
// chunk) and has `byte_size` bytes.
struct CudaSetMember {
  std::string ipc_handle;
  std::vector<int> fds;
  std::vector<uint64_t> chunk_bytes;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

struct RegionSetSummary {
  std::string name;
  RegionKind kind = RegionKind::kShm;
  uint32_t members = 0;
  int device = -1;           // CUDA: the GPU of every member
  uint32_t vmm_members = 0;  // CUDA: members that are VMM allocations
  uint64_t byte_size = 0;    // the members' sizes added up
  std::string client;
  std::string owner;
  int64_t in_use = 0;
  int64_t calls = 0;
  std::vector<uint32_t> lost;  // the members whose memory was lost
};

// Which region a tensor names: `name`, or member `index` of set `set` when `set` is not empty.
struct RegionName {
  std::string name;
  std::string set;
  uint32_t index = 0;
};

// Keeps one call's use of a region: while it lives, the region stays mapped and an unregister
// waits.
class RegionUse;
using RegionPin = std::shared_ptr<RegionUse>;

// A checked byte range of a registered region.
struct RegionRange {
  RegionPin pin;
  const MappedRegion* region = nullptr;
  char* data = nullptr;                // region->base() + offset
  const std::string* label = nullptr;  // "pool", or "layers[3]" for a set's member (for errors)
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  int device() const { return region->device(); }
};

// OK unless the memory of a region the call pinned was lost while the call ran (a client shrank
// its shm object: sigbus_guard.h); then what the call read is void. FAILED_PRECONDITION names
// the region.
absl::Status RegionsIntact(const std::vector<RegionPin>& pins);

class RegionRegistry {
 public:
  // Opens a CUDA IPC handle on a device (the engine's); FAILED_PRECONDITION when it cannot.
  using CudaOpener = std::function<absl::StatusOr<std::unique_ptr<MappedRegion>>(
      int device, const std::string& handle, uint64_t byte_size)>;
  // Imports the chunks of a CUDA VMM allocation (one descriptor each, borrowed: the caller closes
  // them) on a device and maps them whole, side by side; the mapping starts `offset` bytes into
  // the first chunk and has `byte_size` bytes. FAILED_PRECONDITION when the engine cannot.
  using VmmImporter = std::function<absl::StatusOr<std::unique_ptr<MappedRegion>>(
      int device, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
      uint64_t offset, uint64_t byte_size)>;
  // Pins a shm region's host memory for the engine's copy engines (host_pinning.h).
  using HostPinner = verifyd::HostPinner;
  // Sees the region count and total bytes after every change (metrics).
  using Observer = std::function<void(int64_t regions, uint64_t bytes)>;

  RegionRegistry(RegionLimits limits, CudaOpener cuda_opener, HostPinner host_pinner = nullptr);
  ~RegionRegistry();
  void SetObserver(Observer o);
  // Set before the registry serves; without one, RegisterCudaVmm is refused.
  void SetVmmImporter(VmmImporter importer) { vmm_importer_ = std::move(importer); }
  const RegionLimits& limits() const { return limits_; }

  // Sees each refused use, unregister or listing of another peer's region (metrics, audit).
  void SetDenialObserver(DenialObserver o);

  // `by`: the registering peer, which owns the region. Its kernel-verified uid must own a shm
  // object (MapShm); over TCP (--allow_region_tcp) verifyd cannot know it and maps any.
  absl::StatusOr<RegionSummary> RegisterShm(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size,
                                            const std::string& client, const Peer& by);
  absl::StatusOr<RegionSummary> RegisterCuda(const std::string& name, const std::string& handle,
                                             int device, uint64_t byte_size,
                                             const std::string& client, const Peer& by);
  // A cuda_ipc region over the chunks of a CUDA VMM allocation (`fds`, one per chunk, of
  // `chunk_bytes` each), which calls name as any cuda_ipc region: it starts `offset` bytes into
  // the first chunk (a multiple of 16) and has `byte_size` bytes, within the chunks. Errors name
  // the field (`chunks[2]: ...`).
  absl::StatusOr<RegionSummary> RegisterCudaVmm(const std::string& name,
                                                const std::vector<int>& fds,
                                                const std::vector<uint64_t>& chunk_bytes,
                                                int device, uint64_t offset, uint64_t byte_size,
                                                const std::string& client, const Peer& by);
  // Registers every member as RegisterShm would, or none: errors name the member
  // (`members[3].key: ...`). Counts members.size() regions against the limits.
  absl::StatusOr<RegionSetSummary> RegisterShmSet(const std::string& name,
                                                  const std::vector<ShmSetMember>& members,
                                                  const std::string& client, const Peer& by);
  // Registers every member on `device` as RegisterCuda (an IPC member) or RegisterCudaVmm (a
  // VMM member) would, or none: errors name the member (`members[3].byte_size: ...`). Members
  // that name one IPC allocation share one opened handle. Counts members.size() regions against
  // the limits.
  absl::StatusOr<RegionSetSummary> RegisterCudaSet(const std::string& name,
                                                   const std::vector<CudaSetMember>& members,
                                                   int device, const std::string& client,
                                                   const Peer& by);
  // Unregisters region or set `name`, or with an empty name every region and set of `client`
  // that `caller` may use (others of that name are left alone). Returns the names (a set's once).
  // PERMISSION_DENIED naming the region when `caller` may not use region or set `name`.
  // Waits up to limits().unregister_wait for the calls that use them; past that, UNAVAILABLE
  // (the regions are unregistered all the same and unmapped when those calls end).
  absl::StatusOr<std::vector<std::string>> Unregister(const std::string& name,
                                                      const std::string& client,
                                                      const Peer& caller);
  // The regions registered alone; sets are in ListSets(). With `visible_to`, only those that peer
  // may use; without, all of them (the operator's view).
  std::vector<RegionSummary> List(const Peer* visible_to = nullptr) const;
  std::vector<RegionSetSummary> ListSets(const Peer* visible_to = nullptr) const;
  uint64_t total_bytes() const;
  // Regions counted against max_regions: set members included.
  int64_t count() const;

  // The range [offset, offset + byte_size) of region `name` of kind `kind`, pinned for one
  // call: `call_pins` holds the call's pins, one per region (a new one is added). `field` names
  // the request field in errors: NOT_FOUND for an unknown region (or one of the other kind),
  // INVALID_ARGUMENT for a range past its end, FAILED_PRECONDITION for a region whose memory
  // was lost (RegionsIntact).
  // With `which.set`: member `which.index` of that set (INVALID_ARGUMENT naming `field` when the
  // set has no such member). PERMISSION_DENIED naming `field` and the region when `caller` may
  // not use it.
  absl::StatusOr<RegionRange> Resolve(const std::string& field, RegionKind kind,
                                      const RegionName& which, uint64_t offset, uint64_t byte_size,
                                      std::vector<RegionPin>* call_pins, const Peer& caller) const;
  absl::StatusOr<RegionRange> Resolve(const std::string& field, RegionKind kind,
                                      const std::string& name, uint64_t offset, uint64_t byte_size,
                                      std::vector<RegionPin>* call_pins, const Peer& caller) const {
    return Resolve(field, kind, RegionName{name, "", 0}, offset, byte_size, call_pins, caller);
  }
  // Regions counted against max_regions_per_uid for `uid`.
  int64_t count_of_uid(uint32_t uid) const;

 private:
  struct Entry;
  struct Set;
  friend class RegionUse;
  // Adds a region alone (`set` null) or a set's members, after checking the limits again.
  absl::Status Add(const std::string& name, std::shared_ptr<Entry> single,
                   std::shared_ptr<Set> set);
  // `n`: how many regions the registration adds; `owner`: whose count they go to.
  absl::Status CheckNew(const std::string& name, uint64_t byte_size, int64_t n,
                        const Peer& owner) const;
  absl::Status CheckLimitsLocked(uint64_t byte_size, int64_t n, const Peer& owner) const;
  // Takes the regions in `gone` (set members included) out of the counts (under mu_).
  void ForgetLocked(const std::vector<std::shared_ptr<Entry>>& gone);
  // PERMISSION_DENIED naming `field` (when not empty) and `what`, reported to the denial
  // observer, when `caller` may not use what `owner` registered; OK otherwise.
  absl::Status Permit(const std::string& field, const std::string& what, const char* action,
                      const Peer& owner, const Peer& caller) const;
  // Unregisters the regions and sets of processes that exited, every reap_every, until the
  // registry goes.
  void ReapLoop();
  // A set's members, described by `infos` (name, kind, sizes; client and owner are set here),
  // mapped by `map(i)`: the logic every kind of set shares (the name, the limits for
  // infos.size() regions, all or nothing).
  using MapMember = std::function<absl::StatusOr<std::unique_ptr<MappedRegion>>(size_t i)>;
  absl::StatusOr<RegionSetSummary> RegisterSet(RegionSetSummary set,
                                               std::vector<RegionSummary> infos, const Peer& by,
                                               const MapMember& map);
  // Each kind's checks and mapping, for a region alone and a set's member alike. `field`
  // prefixes the errors' field names ("" or "members[3].").
  absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaChecked(const std::string& field,
                                                                const std::string& handle,
                                                                int device, uint64_t byte_size);
  absl::StatusOr<std::unique_ptr<MappedRegion>> ImportVmmChecked(
      const std::string& field, const std::vector<int>& fds,
      const std::vector<uint64_t>& chunk_bytes, int device, uint64_t offset, uint64_t byte_size);
  absl::StatusOr<std::unique_ptr<MappedRegion>> MapShmChecked(const std::string& field,
                                                              const std::string& label,
                                                              const std::string& key,
                                                              uint64_t offset, uint64_t byte_size,
                                                              const Peer& by);
  static RegionSummary Summarize(const Entry& e);
  static RegionSetSummary Summarize(const Set& s);
  // OK, or FAILED_PRECONDITION naming `field` (when not empty) and the region: its memory was lost.
  static absl::Status Intact(const std::string& field, const Entry& e);
  void Notify();

  RegionLimits limits_;
  CudaOpener cuda_opener_;
  VmmImporter vmm_importer_;
  HostPinner host_pinner_;
  Observer observer_;
  mutable std::mutex mu_;
  std::condition_variable released_;                       // a pin went away
  std::map<std::string, std::shared_ptr<Entry>> regions_;  // guarded by mu_; alone
  std::map<std::string, std::shared_ptr<Set>> sets_;       // guarded by mu_
  int64_t count_ = 0;                                      // guarded by mu_; members included
  std::map<std::string, int64_t> owner_counts_;            // guarded by mu_
  std::map<uint32_t, int64_t> uid_counts_;                 // guarded by mu_
  uint64_t total_bytes_ = 0;                               // guarded by mu_
  DenialObserver on_denial_;                               // set before serving
  // The processes that registered what is registered, by pid (guarded by mu_).
  std::map<int, ProcessWatch> watches_;
  std::condition_variable reap_cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread reaper_;     // last: runs ReapLoop over the members above
};

}  // namespace verifyd
