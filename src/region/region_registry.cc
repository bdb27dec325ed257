#include "src/region/region_registry.h"

#include <atomic>
#include <chrono>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/region/shm_mapping.h"

namespace verifyd {
namespace {

// `st` with its message prefixed by `field` ("members[3]."), or as it is for an empty one.
absl::Status Prefixed(const std::string& field, const absl::Status& st) {
  return field.empty() || st.ok() ? st : absl::Status(st.code(), absl::StrCat(field, st.message()));
}

// [offset, offset + byte_size) of a mapping that others may share (set members in one CUDA IPC
// allocation: the handle is opened once).
class MappedSlice final : public MappedRegion {
 public:
  MappedSlice(std::shared_ptr<MappedRegion> whole, uint64_t offset, uint64_t byte_size)
      : whole_(std::move(whole)), offset_(offset), byte_size_(byte_size) {}
  char* base() const override { return whole_->base() + offset_; }
  uint64_t byte_size() const override { return byte_size_; }
  int device() const override { return whole_->device(); }
  bool intact() const override { return whole_->intact(); }
  absl::Status ReadToHost(uint64_t offset, uint64_t bytes, void* dst) const override {
    return whole_->ReadToHost(offset_ + offset, bytes, dst);
  }

 private:
  std::shared_ptr<MappedRegion> whole_;
  uint64_t offset_;
  uint64_t byte_size_;
};

absl::Status CheckOffset(uint64_t offset) {
  if (offset % kRegionAlign == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("offset: ", offset, " is not a multiple of ",
                                                 kRegionAlign, " (regions start ", kRegionAlign,
                                                 "-byte aligned)"));
}

}  // namespace

struct RegionRegistry::Set {
  RegionSetSummary info;  // in_use, calls and lost are the members'
  Peer by;                // the owner
  std::vector<std::shared_ptr<Entry>> members;
};

struct RegionRegistry::Entry {
  RegionSummary info;  // in_use and calls are kept below
  Peer by;             // the owner
  std::unique_ptr<MappedRegion> mapping;
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> calls{0};
  mutable std::atomic<bool> loss_logged{false};
  RegionRegistry* owner = nullptr;
  bool member = false;  // of a set: logged as the set, not one line per member
  ~Entry() {
    if (mapping && !member) spdlog::info("region '{}' unmapped", info.name);
  }
};

class RegionUse {
 public:
  explicit RegionUse(std::shared_ptr<RegionRegistry::Entry> e) : entry_(std::move(e)) {
    ++entry_->in_use;
    ++entry_->calls;
  }
  bool Of(const RegionRegistry::Entry* e) const { return entry_.get() == e; }
  absl::Status Intact() const { return RegionRegistry::Intact("", *entry_); }
  ~RegionUse() {
    --entry_->in_use;
    entry_->owner->Notify();
  }
  RegionUse(const RegionUse&) = delete;
  RegionUse& operator=(const RegionUse&) = delete;

 private:
  std::shared_ptr<RegionRegistry::Entry> entry_;
};

absl::Status RegionRegistry::Intact(const std::string& field, const Entry& e) {
  if (e.mapping->intact()) return absl::OkStatus();
  if (!e.loss_logged.exchange(true)) {
    spdlog::warn(
        "region '{}' (client '{}'): its shared-memory object shrank below the "
        "registered {} bytes; calls naming it are refused until it is unregistered",
        e.info.name, e.info.client, e.info.byte_size);
  }
  return absl::FailedPreconditionError(absl::StrCat(
      field, field.empty() ? "" : ": ", "region '", e.info.name,
      "' lost its memory: its shared-memory object shrank below the registered size (truncated "
      "by its owner); unregister the region and register it again"));
}

absl::Status RegionsIntact(const std::vector<RegionPin>& pins) {
  for (const RegionPin& p : pins) {
    if (absl::Status st = p->Intact(); !st.ok()) return st;
  }
  return absl::OkStatus();
}

const char* RegionKindName(RegionKind k) { return k == RegionKind::kShm ? "shm" : "cuda_ipc"; }

RegionRegistry::RegionRegistry(RegionLimits limits, CudaOpener cuda_opener, HostPinner host_pinner)
    : limits_(limits),
      cuda_opener_(std::move(cuda_opener)),
      host_pinner_(std::move(host_pinner)),
      reaper_([this] { ReapLoop(); }) {}

RegionRegistry::~RegionRegistry() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  reap_cv_.notify_all();
  reaper_.join();
  std::lock_guard<std::mutex> l(mu_);
  regions_.clear();
  sets_.clear();
}

void RegionRegistry::SetDenialObserver(DenialObserver o) { on_denial_ = std::move(o); }

absl::Status RegionRegistry::Permit(const std::string& field, const std::string& what,
                                    const char* action, const Peer& owner,
                                    const Peer& caller) const {
  if (MayUse(limits_.sharing, owner, caller)) return absl::OkStatus();
  if (on_denial_) on_denial_(Denial{"region", what, action, &caller, owner.label});
  return absl::PermissionDeniedError(absl::StrCat(
      field, field.empty() ? "" : ": ", what, " belongs to ", owner.label, ", not to the caller (",
      caller.label.empty() ? "unverified" : caller.label,
      "); --region_sharing=", SharingName(limits_.sharing), " lets ",
      limits_.sharing == Sharing::kProcess ? "only the registering process" : "only its uid",
      " use, list or unregister it"));
}

void RegionRegistry::ReapLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!reap_cv_.wait_for(l, absl::ToChronoNanoseconds(limits_.reap_every),
                            [this] { return stopping_; })) {
    std::vector<int> exited;
    for (const auto& [pid, w] : watches_) {
      if (w.gone()) exited.push_back(pid);
    }
    if (exited.empty()) continue;
    std::vector<std::shared_ptr<Entry>> gone;
    std::vector<std::string> names;
    auto exited_pid = [&](const Peer& by) {
      return by.pid && absl::c_linear_search(exited, *by.pid);
    };
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (!exited_pid(it->second->by)) {
        ++it;
        continue;
      }
      gone.push_back(it->second);
      names.push_back(absl::StrCat("region '", it->first, "'"));
      it = regions_.erase(it);
    }
    for (auto it = sets_.begin(); it != sets_.end();) {
      if (!exited_pid(it->second->by)) {
        ++it;
        continue;
      }
      for (const auto& m : it->second->members) gone.push_back(m);
      names.push_back(absl::StrCat("region set '", it->first, "'"));
      it = sets_.erase(it);
    }
    for (int pid : exited) watches_.erase(pid);
    ForgetLocked(gone);
    // The mappings go when the calls that pinned them end; nothing waits for them here.
    l.unlock();
    for (const std::string& n : names) {
      spdlog::info("{} unregistered: the process that registered it exited", n);
    }
    gone.clear();
    l.lock();
  }
}

void RegionRegistry::ForgetLocked(const std::vector<std::shared_ptr<Entry>>& gone) {
  for (const auto& e : gone) {
    total_bytes_ -= e->info.byte_size;
    --count_;
    auto oc = owner_counts_.find(e->info.owner);
    if (oc != owner_counts_.end() && --oc->second <= 0) owner_counts_.erase(oc);
    if (e->by.uid) {
      auto uc = uid_counts_.find(*e->by.uid);
      if (uc != uid_counts_.end() && --uc->second <= 0) uid_counts_.erase(uc);
    }
  }
  if (observer_) observer_(count_, total_bytes_);
}

int64_t RegionRegistry::count_of_uid(uint32_t uid) const {
  std::lock_guard<std::mutex> l(mu_);
  const auto it = uid_counts_.find(uid);
  return it == uid_counts_.end() ? 0 : it->second;
}

void RegionRegistry::SetObserver(Observer o) {
  std::lock_guard<std::mutex> l(mu_);
  observer_ = std::move(o);
  if (observer_) observer_(count_, total_bytes_);
}

void RegionRegistry::Notify() {
  std::lock_guard<std::mutex> l(mu_);
  released_.notify_all();
}

RegionSummary RegionRegistry::Summarize(const Entry& e) {
  RegionSummary s = e.info;
  s.in_use = e.in_use.load();
  s.calls = e.calls.load();
  s.lost = !e.mapping->intact();
  return s;
}

RegionSetSummary RegionRegistry::Summarize(const Set& set) {
  RegionSetSummary s = set.info;
  s.in_use = 0;
  s.calls = 0;
  s.lost.clear();
  for (size_t i = 0; i < set.members.size(); ++i) {
    const Entry& e = *set.members[i];
    s.in_use += e.in_use.load();
    s.calls += e.calls.load();
    if (!e.mapping->intact()) s.lost.push_back(static_cast<uint32_t>(i));
  }
  return s;
}

absl::Status RegionRegistry::CheckLimitsLocked(uint64_t byte_size, int64_t n,
                                               const Peer& by) const {
  const std::string& owner = by.label;
  if (count_ + n > limits_.max_regions) {
    return absl::ResourceExhaustedError(
        n == 1 ? absl::StrCat("name: ", count_,
                              " regions are registered (set members included), the most "
                              "--max_regions allows")
               : absl::StrCat("name: ", count_,
                              " regions are registered (set members included) and this set adds ",
                              n, ", more than --max_regions (", limits_.max_regions, ") allows"));
  }
  const auto it = owner_counts_.find(owner);
  const int64_t mine = it == owner_counts_.end() ? 0 : it->second;
  if (mine + n > limits_.max_regions_per_client) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "name: client ", owner.empty() ? "(unknown)" : owner, " has ", mine,
        " regions registered (set members included)",
        n == 1 ? "" : absl::StrCat(" and this set adds ", n),
        ", the most --max_regions_per_client (", limits_.max_regions_per_client, ") allows"));
  }
  if (by.uid) {
    const auto uc = uid_counts_.find(*by.uid);
    const int64_t ours = uc == uid_counts_.end() ? 0 : uc->second;
    if (ours + n > limits_.max_regions_per_uid) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "name: uid ", *by.uid, " has ", ours,
          " regions registered by all its processes (set members included)",
          n == 1 ? "" : absl::StrCat(" and this set adds ", n),
          ", the most --max_regions_per_uid (", limits_.max_regions_per_uid, ") allows"));
    }
  }
  if (byte_size > limits_.max_total_bytes - std::min(total_bytes_, limits_.max_total_bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("byte_size: ", byte_size, " more bytes would exceed --max_region_mb (",
                     limits_.max_total_bytes, " bytes; ", total_bytes_, " registered)"));
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::CheckNew(const std::string& name, uint64_t byte_size, int64_t n,
                                      const Peer& owner) const {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("name: must have 1 to 128 characters");
  }
  std::lock_guard<std::mutex> l(mu_);
  if (regions_.count(name) != 0 || sets_.count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: ", regions_.count(name) != 0 ? "region '" : "region set '", name,
                     "' is already registered (unregister it first)"));
  }
  return CheckLimitsLocked(byte_size, n, owner);
}

absl::Status RegionRegistry::Add(const std::string& name, std::shared_ptr<Entry> single,
                                 std::shared_ptr<Set> set) {
  std::lock_guard<std::mutex> l(mu_);
  // Checked again under the lock: another registration may have come in while this one mapped.
  if (regions_.count(name) != 0 || sets_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: '", name, "' is already registered"));
  }
  const int64_t n = set ? static_cast<int64_t>(set->members.size()) : 1;
  const uint64_t bytes = set ? set->info.byte_size : single->info.byte_size;
  const Peer& by = set ? set->by : single->by;
  const std::string& owner = by.label;
  if (absl::Status st = CheckLimitsLocked(bytes, n, by); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat(st.message(), " (reached meanwhile)"));
  }
  if (set) {
    for (const auto& m : set->members) m->owner = this;
    sets_[name] = set;
    spdlog::info("region set '{}' registered: {} members, {} {} bytes (client '{}', {})", name, n,
                 RegionKindName(set->info.kind), bytes, set->info.client, owner);
  } else {
    single->owner = this;
    regions_[name] = single;
    spdlog::info("region '{}' registered: {} {} bytes (client '{}', {})", name,
                 RegionKindName(single->info.kind), bytes, single->info.client, owner);
  }
  count_ += n;
  owner_counts_[owner] += n;
  if (by.uid) uid_counts_[*by.uid] += n;
  if (by.pid && watches_.count(*by.pid) == 0) watches_.emplace(*by.pid, ProcessWatch(*by.pid));
  total_bytes_ += bytes;
  if (observer_) observer_(count_, total_bytes_);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MappedRegion>> RegionRegistry::MapShmChecked(
    const std::string& field, const std::string& label, const std::string& key, uint64_t offset,
    uint64_t byte_size, const Peer& by) {
  if (byte_size == 0) return Prefixed(field, absl::InvalidArgumentError("byte_size: must be > 0"));
  if (absl::Status st = CheckOffset(offset); !st.ok()) return Prefixed(field, st);
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = MapShm(key, offset, byte_size, by.uid);
  if (!m.ok()) return Prefixed(field, m.status());
  PinnedHost pinned = PinHost(host_pinner_, (*m)->base(), byte_size, label);
  if (pinned.unpin) (*m)->SetBeforeUnmap(std::move(pinned.unpin));
  return m;
}

absl::StatusOr<RegionSummary> RegionRegistry::RegisterShm(const std::string& name,
                                                          const std::string& key, uint64_t offset,
                                                          uint64_t byte_size,
                                                          const std::string& client,
                                                          const Peer& by) {
  if (absl::Status st = CheckNew(name, byte_size, 1, by); !st.ok()) return st;
  absl::StatusOr<std::unique_ptr<MappedRegion>> m =
      MapShmChecked("", absl::StrCat("region '", name, "'"), key, offset, byte_size, by);
  if (!m.ok()) return m.status();
  auto e = std::make_shared<Entry>();
  e->info.name = name;
  e->info.kind = RegionKind::kShm;
  e->info.shm_key = key;
  e->info.shm_offset = offset;
  e->info.byte_size = byte_size;
  e->info.client = client;
  e->info.owner = by.label;
  e->by = by;
  e->mapping = std::move(*m);
  if (absl::Status st = Add(name, e, nullptr); !st.ok()) return st;
  return Summarize(*e);
}

absl::StatusOr<RegionSetSummary> RegionRegistry::RegisterSet(RegionSetSummary set_info,
                                                             std::vector<RegionSummary> infos,
                                                             const Peer& by, const MapMember& map) {
  const std::string name = set_info.name;
  if (infos.empty()) {
    return absl::InvalidArgumentError("members: a region set needs at least one member");
  }
  uint64_t bytes = 0;
  for (const RegionSummary& m : infos) {
    if (__builtin_add_overflow(bytes, m.byte_size, &bytes)) bytes = UINT64_MAX;
  }
  if (absl::Status st = CheckNew(name, bytes, static_cast<int64_t>(infos.size()), by); !st.ok()) {
    return st;
  }
  auto set = std::make_shared<Set>();
  set->info = std::move(set_info);
  set->info.owner = by.label;
  set->by = by;
  set->info.members = static_cast<uint32_t>(infos.size());
  set->info.byte_size = bytes;
  for (size_t i = 0; i < infos.size(); ++i) {
    // A member that fails unmaps the ones mapped before it (set goes out of scope).
    absl::StatusOr<std::unique_ptr<MappedRegion>> mapped = map(i);
    if (!mapped.ok()) return mapped.status();
    auto e = std::make_shared<Entry>();
    e->info = std::move(infos[i]);
    e->info.name = absl::StrCat(name, "[", i, "]");
    e->info.kind = set->info.kind;
    e->info.client = set->info.client;
    e->info.owner = set->info.owner;
    e->by = by;
    e->member = true;
    e->mapping = std::move(*mapped);
    set->members.push_back(std::move(e));
  }
  if (absl::Status st = Add(name, nullptr, set); !st.ok()) return st;
  return Summarize(*set);
}

absl::StatusOr<RegionSetSummary> RegionRegistry::RegisterShmSet(
    const std::string& name, const std::vector<ShmSetMember>& members, const std::string& client,
    const Peer& by) {
  RegionSetSummary set;
  set.name = name;
  set.kind = RegionKind::kShm;
  set.client = client;
  std::vector<RegionSummary> infos(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    infos[i].shm_key = members[i].key;
    infos[i].shm_offset = members[i].offset;
    infos[i].byte_size = members[i].byte_size;
  }
  return RegisterSet(std::move(set), std::move(infos), by, [&](size_t i) {
    const ShmSetMember& m = members[i];
    return MapShmChecked(absl::StrCat("members[", i, "]."),
                         absl::StrCat("region '", name, "[", i, "]'"), m.key, m.offset, m.byte_size,
                         by);
  });
}

absl::StatusOr<RegionSetSummary> RegionRegistry::RegisterCudaSet(
    const std::string& name, const std::vector<CudaSetMember>& members, int device,
    const std::string& client, const Peer& by) {
  RegionSetSummary set;
  set.name = name;
  set.kind = RegionKind::kCudaIpc;
  set.device = device;
  set.client = client;
  std::vector<RegionSummary> infos(members.size());
  // Members in one CUDA IPC allocation share one opened handle, opened once with the largest
  // extent any of them names (by that member: its field is the one an error names).
  struct Opened {
    size_t widest = 0;
    uint64_t extent = 0;
    std::shared_ptr<MappedRegion> mapping;
  };
  std::map<std::string, Opened> handles;
  for (size_t i = 0; i < members.size(); ++i) {
    const CudaSetMember& m = members[i];
    const std::string field = absl::StrCat("members[", i, "]");
    if (m.ipc_handle.empty() == m.chunk_bytes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": names ", m.ipc_handle.empty() ? "neither" : "both",
          " an ipc_handle (a CUDA IPC allocation) and chunks (a VMM allocation); name one"));
    }
    infos[i].device = device;
    infos[i].byte_size = m.byte_size;
    if (m.ipc_handle.empty()) {
      ++set.vmm_members;
      continue;
    }
    if (m.byte_size == 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size: must be > 0"));
    }
    if (absl::Status st = CheckOffset(m.offset); !st.ok()) return Prefixed(field + ".", st);
    uint64_t extent = 0;
    if (__builtin_add_overflow(m.offset, m.byte_size, &extent)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".byte_size: offset ", m.offset, " + ", m.byte_size, " overflows"));
    }
    Opened& h = handles[m.ipc_handle];
    if (extent > h.extent) h = {i, extent, nullptr};
  }
  return RegisterSet(
      std::move(set), std::move(infos), by,
      [&](size_t i) -> absl::StatusOr<std::unique_ptr<MappedRegion>> {
        const CudaSetMember& m = members[i];
        if (m.ipc_handle.empty()) {
          return ImportVmmChecked(absl::StrCat("members[", i, "]."), m.fds, m.chunk_bytes, device,
                                  m.offset, m.byte_size);
        }
        Opened& h = handles[m.ipc_handle];
        if (!h.mapping) {
          absl::StatusOr<std::unique_ptr<MappedRegion>> opened = OpenCudaChecked(
              absl::StrCat("members[", h.widest, "]."), m.ipc_handle, device, h.extent);
          if (!opened.ok()) return opened.status();
          h.mapping = std::move(*opened);
        }
        return std::unique_ptr<MappedRegion>(new MappedSlice(h.mapping, m.offset, m.byte_size));
      });
}

absl::StatusOr<std::unique_ptr<MappedRegion>> RegionRegistry::OpenCudaChecked(
    const std::string& field, const std::string& handle, int device, uint64_t byte_size) {
  if (byte_size == 0) return Prefixed(field, absl::InvalidArgumentError("byte_size: must be > 0"));
  if (handle.size() != 64) {
    return Prefixed(field, absl::InvalidArgumentError(absl::StrCat(
                               "ipc_handle: ", handle.size(),
                               " bytes, expected the 64 bytes of a cudaIpcMemHandle_t")));
  }
  if (!cuda_opener_) {
    return Prefixed(field, absl::FailedPreconditionError(
                               "ipc_handle: this engine cannot open CUDA IPC regions (run "
                               "verifyd with --engine=cuda)"));
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = cuda_opener_(device, handle, byte_size);
  if (!m.ok()) return Prefixed(field, m.status());
  return m;
}

absl::StatusOr<std::unique_ptr<MappedRegion>> RegionRegistry::ImportVmmChecked(
    const std::string& field, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
    int device, uint64_t offset, uint64_t byte_size) {
  auto invalid = [&field](const std::string& message) {
    return Prefixed(field, absl::InvalidArgumentError(message));
  };
  if (byte_size == 0) return invalid("byte_size: must be > 0");
  if (chunk_bytes.empty()) return invalid("chunks: a VMM region needs at least one chunk");
  if (chunk_bytes.size() != fds.size()) {
    return invalid(absl::StrCat("chunks: ", chunk_bytes.size(), " chunk sizes for the ", fds.size(),
                                " descriptors sent under the token (one descriptor a chunk, in "
                                "order)"));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < chunk_bytes.size(); ++i) {
    if (chunk_bytes[i] == 0) return invalid(absl::StrCat("chunks[", i, "]: must be > 0 bytes"));
    if (__builtin_add_overflow(total, chunk_bytes[i], &total)) {
      return invalid(absl::StrCat("chunks[", i, "]: the sizes overflow"));
    }
  }
  if (absl::Status st = CheckOffset(offset); !st.ok()) return Prefixed(field, st);
  if (offset >= chunk_bytes[0]) {
    return invalid(absl::StrCat("offset: ", offset, " is past the end of the first chunk (",
                                chunk_bytes[0], " bytes)"));
  }
  if (byte_size > total - offset) {
    return invalid(absl::StrCat("byte_size: offset ", offset, " + ", byte_size,
                                " bytes is past the end of the chunks (", total, " bytes)"));
  }
  if (!vmm_importer_) {
    return Prefixed(field, absl::FailedPreconditionError(
                               "chunks: this engine cannot import CUDA VMM allocations (run "
                               "verifyd with --engine=cuda)"));
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> m =
      vmm_importer_(device, fds, chunk_bytes, offset, byte_size);
  if (!m.ok()) return Prefixed(field, m.status());
  return m;
}

absl::StatusOr<RegionSummary> RegionRegistry::RegisterCuda(const std::string& name,
                                                           const std::string& handle, int device,
                                                           uint64_t byte_size,
                                                           const std::string& client,
                                                           const Peer& by) {
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  if (absl::Status st = CheckNew(name, byte_size, 1, by); !st.ok()) return st;
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = OpenCudaChecked("", handle, device, byte_size);
  if (!m.ok()) return m.status();
  auto e = std::make_shared<Entry>();
  e->info.name = name;
  e->info.kind = RegionKind::kCudaIpc;
  e->info.device = device;
  e->info.byte_size = byte_size;
  e->info.client = client;
  e->info.owner = by.label;
  e->by = by;
  e->mapping = std::move(*m);
  if (absl::Status st = Add(name, e, nullptr); !st.ok()) return st;
  return Summarize(*e);
}

absl::StatusOr<RegionSummary> RegionRegistry::RegisterCudaVmm(
    const std::string& name, const std::vector<int>& fds, const std::vector<uint64_t>& chunk_bytes,
    int device, uint64_t offset, uint64_t byte_size, const std::string& client, const Peer& by) {
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  if (absl::Status st = CheckNew(name, byte_size, 1, by); !st.ok()) return st;
  absl::StatusOr<std::unique_ptr<MappedRegion>> m =
      ImportVmmChecked("", fds, chunk_bytes, device, offset, byte_size);
  if (!m.ok()) return m.status();
  auto e = std::make_shared<Entry>();
  e->info.name = name;
  e->info.kind = RegionKind::kCudaIpc;
  e->info.device = device;
  e->info.byte_size = byte_size;
  e->info.client = client;
  e->info.owner = by.label;
  e->by = by;
  e->mapping = std::move(*m);
  if (absl::Status st = Add(name, e, nullptr); !st.ok()) return st;
  return Summarize(*e);
}

absl::StatusOr<std::vector<std::string>> RegionRegistry::Unregister(const std::string& name,
                                                                    const std::string& client,
                                                                    const Peer& caller) {
  std::unique_lock<std::mutex> l(mu_);
  std::vector<std::shared_ptr<Entry>> gone;
  std::vector<std::string> names;
  std::vector<std::string> sets;  // for the log
  auto drop_set = [&](const std::shared_ptr<Set>& s) {
    names.push_back(s->info.name);
    sets.push_back(s->info.name);
    for (const auto& m : s->members) gone.push_back(m);
  };
  if (!name.empty()) {
    auto it = regions_.find(name);
    auto sit = sets_.find(name);
    if (it != regions_.end()) {
      if (absl::Status st = Permit("name", absl::StrCat("region '", name, "'"), "unregister",
                                   it->second->by, caller);
          !st.ok()) {
        return st;
      }
      gone.push_back(it->second);
      names.push_back(name);
      regions_.erase(it);
    } else if (sit != sets_.end()) {
      if (absl::Status st = Permit("name", absl::StrCat("region set '", name, "'"), "unregister",
                                   sit->second->by, caller);
          !st.ok()) {
        return st;
      }
      drop_set(sit->second);
      sets_.erase(sit);
    } else {
      return absl::NotFoundError(
          absl::StrCat("name: no region or region set '", name, "' is registered"));
    }
  } else {
    // Another peer's regions of that client name are not the caller's: left alone, unreported
    // (a client name is anyone's to choose).
    auto mine = [&](const Peer& by) { return MayUse(limits_.sharing, by, caller); };
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second->info.client == client && mine(it->second->by)) {
        gone.push_back(it->second);
        names.push_back(it->first);
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = sets_.begin(); it != sets_.end();) {
      if (it->second->info.client == client && mine(it->second->by)) {
        drop_set(it->second);
        it = sets_.erase(it);
      } else {
        ++it;
      }
    }
  }
  ForgetLocked(gone);
  auto busy = [&gone] {
    int64_t n = 0;
    for (const auto& e : gone) n += e->in_use.load();
    return n;
  };
  const bool idle = released_.wait_for(l, absl::ToChronoNanoseconds(limits_.unregister_wait),
                                       [&] { return busy() == 0; });
  l.unlock();
  for (const std::string& n : names) {
    spdlog::info("{} '{}' unregistered", absl::c_linear_search(sets, n) ? "region set" : "region",
                 n);
  }
  if (!idle) {
    return absl::UnavailableError(
        absl::StrCat("name: still used by ", busy(), " calls after ",
                     absl::FormatDuration(limits_.unregister_wait),
                     "; unregistered all the same, unmapped when those calls end"));
  }
  return names;
}

std::vector<RegionSummary> RegionRegistry::List(const Peer* visible_to) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<RegionSummary> out;
  for (const auto& [n, e] : regions_) {
    if (visible_to == nullptr || MayUse(limits_.sharing, e->by, *visible_to)) {
      out.push_back(Summarize(*e));
    }
  }
  return out;
}

std::vector<RegionSetSummary> RegionRegistry::ListSets(const Peer* visible_to) const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<RegionSetSummary> out;
  for (const auto& [n, s] : sets_) {
    if (visible_to == nullptr || MayUse(limits_.sharing, s->by, *visible_to)) {
      out.push_back(Summarize(*s));
    }
  }
  return out;
}

int64_t RegionRegistry::count() const {
  std::lock_guard<std::mutex> l(mu_);
  return count_;
}

uint64_t RegionRegistry::total_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return total_bytes_;
}

absl::StatusOr<RegionRange> RegionRegistry::Resolve(const std::string& field, RegionKind kind,
                                                    const RegionName& which, uint64_t offset,
                                                    uint64_t byte_size,
                                                    std::vector<RegionPin>* call_pins,
                                                    const Peer& caller) const {
  std::shared_ptr<Entry> e;
  const std::string& name = which.set.empty() ? which.name : which.set;
  if (which.set.empty()) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = regions_.find(which.name);
    if (it != regions_.end() && it->second->info.kind == kind) e = it->second;
  } else {
    if (!which.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": names both region '", which.name, "' and region set '", which.set,
                       "'; name one (a set's member by set and index, with region empty)"));
    }
    std::lock_guard<std::mutex> l(mu_);
    auto it = sets_.find(which.set);
    if (it != sets_.end() && it->second->info.kind == kind) {
      // Another peer's set is refused before anything about it (its members) is told.
      if (absl::Status st = Permit(field, absl::StrCat("region set '", which.set, "'"), "use",
                                   it->second->by, caller);
          !st.ok()) {
        return st;
      }
      const std::vector<std::shared_ptr<Entry>>& members = it->second->members;
      if (which.index >= members.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": index ", which.index, " is out of range for region set '", which.set, "' (",
            members.size(), " members, 0 to ", members.size() - 1, ")"));
      }
      e = members[which.index];
    }
  }
  if (!e) {
    return absl::NotFoundError(absl::StrCat(field, ": no ", RegionKindName(kind),
                                            which.set.empty() ? " region '" : " region set '", name,
                                            "' is registered"));
  }
  // "region 'pool'", or "member 3 of region set 'layers'".
  const std::string what =
      which.set.empty() ? absl::StrCat("region '", name, "'")
                        : absl::StrCat("member ", which.index, " of region set '", name, "'");
  // Another peer's region is refused before anything about it (its size) is told.
  if (which.set.empty()) {
    if (absl::Status st = Permit(field, what, "use", e->by, caller); !st.ok()) return st;
  }
  const uint64_t size = e->info.byte_size;
  if (offset > size || byte_size > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + byte_size ",
                                                   byte_size, " is past the end of ", what, " (",
                                                   size, " bytes)"));
  }
  if (absl::Status st = Intact(field, *e); !st.ok()) return st;
  if (offset % kRegionAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": offset ", offset, " in ", what, " is not a multiple of ",
                     kRegionAlign, " (tensors in regions start ", kRegionAlign, "-byte aligned)"));
  }
  RegionRange r;
  for (const RegionPin& p : *call_pins) {
    if (p->Of(e.get())) r.pin = p;
  }
  if (!r.pin) {
    r.pin = std::make_shared<RegionUse>(e);
    call_pins->push_back(r.pin);
  }
  r.region = e->mapping.get();
  r.data = e->mapping->base() + offset;
  r.label = &e->info.name;
  r.offset = offset;
  r.byte_size = byte_size;
  return r;
}

}  // namespace verifyd
