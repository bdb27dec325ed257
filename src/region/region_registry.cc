#include "src/region/region_registry.h"

#include <atomic>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"
#include "src/region/shm_mapping.h"

namespace verifyd {

struct RegionRegistry::Entry {
  RegionSummary info;  // in_use and calls are kept below
  std::unique_ptr<MappedRegion> mapping;
  std::atomic<int64_t> in_use{0};
  std::atomic<int64_t> calls{0};
  mutable std::atomic<bool> loss_logged{false};
  RegionRegistry* owner = nullptr;
  ~Entry() {
    if (mapping) spdlog::info("region '{}' unmapped", info.name);
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
    : limits_(limits), cuda_opener_(std::move(cuda_opener)), host_pinner_(std::move(host_pinner)) {}

RegionRegistry::~RegionRegistry() {
  std::lock_guard<std::mutex> l(mu_);
  regions_.clear();
}

void RegionRegistry::SetObserver(Observer o) {
  std::lock_guard<std::mutex> l(mu_);
  observer_ = std::move(o);
  if (observer_) observer_(static_cast<int64_t>(regions_.size()), total_bytes_);
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

absl::Status RegionRegistry::CheckNewName(const std::string& name, uint64_t byte_size) const {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("name: must have 1 to 128 characters");
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size: must be > 0");
  std::lock_guard<std::mutex> l(mu_);
  if (regions_.count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: region '", name, "' is already registered (unregister it first)"));
  }
  if (static_cast<int64_t>(regions_.size()) >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "name: ", regions_.size(), " regions are registered, the most --max_regions allows"));
  }
  if (byte_size > limits_.max_total_bytes - std::min(total_bytes_, limits_.max_total_bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("byte_size: ", byte_size, " more bytes would exceed --max_region_bytes (",
                     limits_.max_total_bytes, " bytes; ", total_bytes_, " registered)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionSummary> RegionRegistry::Add(std::shared_ptr<Entry> e) {
  std::lock_guard<std::mutex> l(mu_);
  // Checked again under the lock: another registration may have come in while this one mapped.
  if (regions_.count(e->info.name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("name: region '", e->info.name, "' is already registered"));
  }
  if (static_cast<int64_t>(regions_.size()) >= limits_.max_regions ||
      e->info.byte_size >
          limits_.max_total_bytes - std::min(total_bytes_, limits_.max_total_bytes)) {
    return absl::ResourceExhaustedError(
        "name: the region limits (--max_regions, "
        "--max_region_bytes) were reached meanwhile");
  }
  e->owner = this;
  total_bytes_ += e->info.byte_size;
  regions_[e->info.name] = e;
  spdlog::info("region '{}' registered: {} {} bytes (client '{}')", e->info.name,
               RegionKindName(e->info.kind), e->info.byte_size, e->info.client);
  if (observer_) observer_(static_cast<int64_t>(regions_.size()), total_bytes_);
  return Summarize(*e);
}

absl::StatusOr<RegionSummary> RegionRegistry::RegisterShm(const std::string& name,
                                                          const std::string& key, uint64_t offset,
                                                          uint64_t byte_size,
                                                          const std::string& client,
                                                          std::optional<uint32_t> caller_uid) {
  if (absl::Status st = CheckNewName(name, byte_size); !st.ok()) return st;
  if (offset % kRegionAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset: ", offset, " is not a multiple of ",
                                                   kRegionAlign, " (regions start ", kRegionAlign,
                                                   "-byte aligned)"));
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = MapShm(key, offset, byte_size, caller_uid);
  if (!m.ok()) return m.status();
  PinnedHost pinned =
      PinHost(host_pinner_, (*m)->base(), byte_size, absl::StrCat("region '", name, "'"));
  if (pinned.unpin) (*m)->SetBeforeUnmap(std::move(pinned.unpin));
  auto e = std::make_shared<Entry>();
  e->info.name = name;
  e->info.kind = RegionKind::kShm;
  e->info.shm_key = key;
  e->info.shm_offset = offset;
  e->info.byte_size = byte_size;
  e->info.client = client;
  e->mapping = std::move(*m);
  return Add(std::move(e));
}

absl::StatusOr<RegionSummary> RegionRegistry::RegisterCuda(const std::string& name,
                                                           const std::string& handle, int device,
                                                           uint64_t byte_size,
                                                           const std::string& client) {
  if (absl::Status st = CheckNewName(name, byte_size); !st.ok()) return st;
  if (handle.size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_handle: ", handle.size(), " bytes, expected the 64 bytes of a cudaIpcMemHandle_t"));
  }
  if (!cuda_opener_) {
    return absl::FailedPreconditionError(
        "ipc_handle: this engine cannot open CUDA IPC regions (run verifyd with --engine=cuda)");
  }
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = cuda_opener_(device, handle, byte_size);
  if (!m.ok()) return m.status();
  auto e = std::make_shared<Entry>();
  e->info.name = name;
  e->info.kind = RegionKind::kCudaIpc;
  e->info.device = device;
  e->info.byte_size = byte_size;
  e->info.client = client;
  e->mapping = std::move(*m);
  return Add(std::move(e));
}

absl::StatusOr<std::vector<std::string>> RegionRegistry::Unregister(const std::string& name,
                                                                    const std::string& client) {
  std::unique_lock<std::mutex> l(mu_);
  std::vector<std::shared_ptr<Entry>> gone;
  if (!name.empty()) {
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("name: no region '", name, "' is registered"));
    }
    gone.push_back(it->second);
    regions_.erase(it);
  } else {
    for (auto it = regions_.begin(); it != regions_.end();) {
      if (it->second->info.client == client) {
        gone.push_back(it->second);
        it = regions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<std::string> names;
  for (const auto& e : gone) {
    total_bytes_ -= e->info.byte_size;
    names.push_back(e->info.name);
  }
  if (observer_) observer_(static_cast<int64_t>(regions_.size()), total_bytes_);
  auto busy = [&gone] {
    int64_t n = 0;
    for (const auto& e : gone) n += e->in_use.load();
    return n;
  };
  const bool idle = released_.wait_for(l, absl::ToChronoNanoseconds(limits_.unregister_wait),
                                       [&] { return busy() == 0; });
  l.unlock();
  for (const std::string& n : names) spdlog::info("region '{}' unregistered", n);
  if (!idle) {
    return absl::UnavailableError(
        absl::StrCat("name: still used by ", busy(), " calls after ",
                     absl::FormatDuration(limits_.unregister_wait),
                     "; unregistered all the same, unmapped when those calls end"));
  }
  return names;
}

std::vector<RegionSummary> RegionRegistry::List() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<RegionSummary> out;
  for (const auto& [n, e] : regions_) out.push_back(Summarize(*e));
  return out;
}

uint64_t RegionRegistry::total_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return total_bytes_;
}

absl::StatusOr<RegionRange> RegionRegistry::Resolve(const std::string& field, RegionKind kind,
                                                    const std::string& name, uint64_t offset,
                                                    uint64_t byte_size,
                                                    std::vector<RegionPin>* call_pins) const {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = regions_.find(name);
    if (it != regions_.end() && it->second->info.kind == kind) e = it->second;
  }
  if (!e) {
    return absl::NotFoundError(
        absl::StrCat(field, ": no ", RegionKindName(kind), " region '", name, "' is registered"));
  }
  const uint64_t size = e->info.byte_size;
  if (offset > size || byte_size > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + byte_size ",
                                                   byte_size, " is past the end of region '", name,
                                                   "' (", size, " bytes)"));
  }
  if (absl::Status st = Intact(field, *e); !st.ok()) return st;
  if (offset % kRegionAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": offset ", offset, " in region '", name, "' is not a multiple of ",
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
  r.offset = offset;
  r.byte_size = byte_size;
  return r;
}

}  // namespace verifyd
