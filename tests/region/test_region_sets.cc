// Region sets in the registry, without a GPU: a CUDA set's members (CUDA IPC handles and VMM
// chunks) are opened by fake engine hooks over host memory, so that what the registry does with
// them can be checked: every member checked as a region alone, errors naming the member's field,
// all or nothing, each member counted against both limits, one handle opened once, and calls
// naming members by (set, index).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/region/region_registry.h"
#include "tests/region/fake_device_memory.h"

namespace verifyd {
namespace {

// A process of this test's uid as the kernel names it (shm objects must be the caller's own),
// without its pid watched (no process exits here).
Peer Process(int pid) {
  Peer p = Peer::Unix(::geteuid(), std::nullopt);
  p.label = "uid " + std::to_string(::geteuid()) + " pid " + std::to_string(pid);
  return p;
}
// The peer that registers the sets.
const Peer kOwner = Process(7);

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint64_t kAllocation = 1 << 16;  // every fake CUDA IPC allocation's size

struct Engine {
  int live = 0;
  std::map<std::string, int> opened;       // handle -> times opened
  std::vector<std::vector<int>> imported;  // the descriptors of each VMM import
  std::vector<uint64_t> extents;           // byte_size of each IPC open

  RegionRegistry::CudaOpener Opener() {
    return [this](int device, const std::string& handle,
                  uint64_t byte_size) -> absl::StatusOr<std::unique_ptr<MappedRegion>> {
      if (handle == std::string(64, 'x')) {
        return absl::InvalidArgumentError("ipc_handle: cudaIpcOpenMemHandle failed");
      }
      if (byte_size > kAllocation) {
        return absl::InvalidArgumentError(
            absl::StrCat("byte_size: ", byte_size, " bytes is past the end of the allocation"));
      }
      ++opened[handle];
      extents.push_back(byte_size);
      return std::unique_ptr<MappedRegion>(new FakeDeviceMemory(device, kAllocation, &live));
    };
  }
  RegionRegistry::VmmImporter Importer() {
    return [this](int device, const std::vector<int>& fds, const std::vector<uint64_t>&, uint64_t,
                  uint64_t byte_size) -> absl::StatusOr<std::unique_ptr<MappedRegion>> {
      imported.push_back(fds);
      return std::unique_ptr<MappedRegion>(new FakeDeviceMemory(device, byte_size, &live));
    };
  }
};

std::unique_ptr<RegionRegistry> Registry(Engine& engine, RegionLimits limits = {}) {
  auto r = std::make_unique<RegionRegistry>(limits, engine.Opener());
  r->SetVmmImporter(engine.Importer());
  return r;
}

CudaSetMember Ipc(int handle, uint64_t offset, uint64_t bytes) {
  CudaSetMember m;
  m.ipc_handle = Handle(handle);
  m.offset = offset;
  m.byte_size = bytes;
  return m;
}

// A VMM member of `chunks` chunks of 4096 bytes, with descriptors first, first + 1, ...
CudaSetMember Vmm(int first_fd, int chunks, uint64_t offset, uint64_t bytes) {
  CudaSetMember m;
  for (int c = 0; c < chunks; ++c) {
    m.fds.push_back(first_fd + c);
    m.chunk_bytes.push_back(4096);
  }
  m.offset = offset;
  m.byte_size = bytes;
  return m;
}

// 61 layer pools, the odd layers in VMM allocations (two chunks each), the even ones each in a
// CUDA IPC allocation of its own.
std::vector<CudaSetMember> Layers(int n = 61) {
  std::vector<CudaSetMember> out;
  for (int i = 0; i < n; ++i) {
    out.push_back(i % 2 ? Vmm(100 + 2 * i, 2, 0, 8192) : Ipc(i % 10, 0, 4096));
    if (i % 2 == 0) out.back().ipc_handle = absl::StrCat(std::string(60, 'h'), 1000 + i);
  }
  return out;
}

TEST(CudaRegionSet, RegistersEveryMemberAsOneEntryCountedMemberByMember) {
  Engine engine;
  auto reg = Registry(engine);
  absl::StatusOr<RegionSetSummary> s = reg->RegisterCudaSet("layers", Layers(), 1, "rank0", kOwner);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->members, 61u);
  EXPECT_EQ(s->vmm_members, 30u);
  EXPECT_EQ(s->device, 1);
  EXPECT_EQ(s->kind, RegionKind::kCudaIpc);
  EXPECT_EQ(s->owner, kOwner.label);
  EXPECT_EQ(s->byte_size, 31u * 4096 + 30u * 8192);
  EXPECT_EQ(reg->count(), 61);
  EXPECT_EQ(reg->total_bytes(), s->byte_size);
  EXPECT_TRUE(reg->List().empty());
  ASSERT_EQ(reg->ListSets().size(), 1u);
  EXPECT_EQ(engine.live, 61);
  // Each VMM member got its own descriptors, in order.
  ASSERT_EQ(engine.imported.size(), 30u);
  EXPECT_EQ(engine.imported[0], (std::vector<int>{102, 103}));
  EXPECT_EQ(engine.imported[29], (std::vector<int>{218, 219}));

  absl::StatusOr<std::vector<std::string>> gone = reg->Unregister("layers", "", kOwner);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(*gone, std::vector<std::string>{"layers"});
  EXPECT_EQ(reg->count(), 0);
  EXPECT_EQ(engine.live, 0);
}

TEST(CudaRegionSet, AMemberThatFailsRegistersNothingAndIsNamedByItsField) {
  struct Case {
    int index;
    CudaSetMember member;
    absl::StatusCode code;
    std::string error;
  };
  CudaSetMember neither;
  neither.byte_size = 64;
  CudaSetMember both = Vmm(7, 1, 0, 64);
  both.ipc_handle = Handle(1);
  CudaSetMember short_handle = Ipc(1, 0, 64);
  short_handle.ipc_handle = "abc";
  CudaSetMember bad_handle = Ipc(1, 0, 64);
  bad_handle.ipc_handle = std::string(64, 'x');
  CudaSetMember fds_missing = Vmm(7, 2, 0, 64);
  fds_missing.fds.pop_back();
  CudaSetMember empty_chunk = Vmm(7, 2, 0, 64);
  empty_chunk.chunk_bytes[1] = 0;
  const std::vector<Case> cases = {
      {3, Ipc(1, 0, kAllocation + 16), absl::StatusCode::kInvalidArgument,
       "members[3].byte_size: 65552 bytes is past the end of the allocation"},
      {5, Ipc(1, 4096, kAllocation - 4080), absl::StatusCode::kInvalidArgument,
       "members[5].byte_size: 65552 bytes is past the end"},
      {2, Ipc(1, 8, 64), absl::StatusCode::kInvalidArgument,
       "members[2].offset: 8 is not a multiple of 16"},
      {4, Ipc(1, 0, 0), absl::StatusCode::kInvalidArgument, "members[4].byte_size: must be > 0"},
      {1, short_handle, absl::StatusCode::kInvalidArgument, "members[1].ipc_handle: 3 bytes"},
      {6, bad_handle, absl::StatusCode::kInvalidArgument,
       "members[6].ipc_handle: cudaIpcOpenMemHandle failed"},
      {0, neither, absl::StatusCode::kInvalidArgument, "members[0]: names neither"},
      {3, both, absl::StatusCode::kInvalidArgument, "members[3]: names both"},
      {7, Vmm(7, 2, 0, 8192 + 16), absl::StatusCode::kInvalidArgument,
       "members[7].byte_size: offset 0 + 8208 bytes is past the end of the chunks (8192 bytes)"},
      {8, Vmm(7, 2, 4096, 64), absl::StatusCode::kInvalidArgument,
       "members[8].offset: 4096 is past the end of the first chunk"},
      {9, Vmm(7, 1, 32, 0), absl::StatusCode::kInvalidArgument,
       "members[9].byte_size: must be > 0"},
      {2, fds_missing, absl::StatusCode::kInvalidArgument,
       "members[2].chunks: 2 chunk sizes for the 1 descriptors"},
      {4, empty_chunk, absl::StatusCode::kInvalidArgument,
       "members[4].chunks[1]: must be > 0 bytes"},
  };
  for (const Case& c : cases) {
    Engine engine;
    auto reg = Registry(engine);
    std::vector<CudaSetMember> members = Layers(10);
    members[c.index] = c.member;
    absl::StatusOr<RegionSetSummary> s = reg->RegisterCudaSet("layers", members, 0, "c", kOwner);
    ASSERT_FALSE(s.ok()) << c.error;
    EXPECT_EQ(s.status().code(), c.code) << s.status();
    EXPECT_THAT(std::string(s.status().message()), StartsWith(c.error));
    EXPECT_EQ(reg->count(), 0) << c.error;
    EXPECT_EQ(reg->total_bytes(), 0u) << c.error;
    EXPECT_TRUE(reg->ListSets().empty()) << c.error;
    EXPECT_EQ(engine.live, 0) << c.error << ": the members opened before it stay open";
    // The name is free again.
    EXPECT_TRUE(reg->RegisterCudaSet("layers", Layers(10), 0, "c", kOwner).ok()) << c.error;
  }
}

TEST(CudaRegionSet, WithoutEngineHooksEveryKindOfMemberIsRefusedByName) {
  RegionRegistry reg(RegionLimits{}, nullptr);
  absl::StatusOr<RegionSetSummary> s =
      reg.RegisterCudaSet("layers", {Vmm(3, 1, 0, 64), Ipc(1, 0, 64)}, 0, "c", kOwner);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.status().message()), StartsWith("members[0].chunks: this engine"));
  s = reg.RegisterCudaSet("layers", {Ipc(1, 0, 64)}, 0, "c", kOwner);
  EXPECT_THAT(std::string(s.status().message()), StartsWith("members[0].ipc_handle: this engine"));
  EXPECT_EQ(reg.count(), 0);
}

TEST(CudaRegionSet, MembersInOneAllocationOpenItsHandleOnceAtTheWidestExtent) {
  Engine engine;
  auto reg = Registry(engine);
  // Four layer pools of 4096 bytes, side by side in one cudaMalloc block, listed out of order.
  std::vector<CudaSetMember> members = {Ipc(1, 8192, 4096), Ipc(1, 0, 4096), Ipc(1, 12288, 4096),
                                        Ipc(1, 4096, 4096), Ipc(2, 0, 256)};
  ASSERT_TRUE(reg->RegisterCudaSet("layers", members, 0, "c", kOwner).ok());
  EXPECT_EQ(engine.opened[Handle(1)], 1);
  EXPECT_EQ(engine.opened[Handle(2)], 1);
  EXPECT_EQ(engine.extents, (std::vector<uint64_t>{16384, 256}));
  EXPECT_EQ(engine.live, 2);
  EXPECT_EQ(reg->count(), 5);
  // Each member starts at its own offset in the one mapping.
  std::vector<RegionPin> pins;
  std::vector<char*> at;
  for (uint32_t i = 0; i < 4; ++i) {
    absl::StatusOr<RegionRange> r = reg->Resolve(
        "kv_pool", RegionKind::kCudaIpc, RegionName{"", "layers", i}, 16, 64, &pins, kOwner);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->device(), 0);
    EXPECT_EQ(r->region->byte_size(), 4096u);
    at.push_back(r->data);
  }
  EXPECT_EQ(at[1] + 4096, at[3]);
  EXPECT_EQ(at[3] + 4096, at[0]);
  EXPECT_EQ(at[0] + 4096, at[2]);
  pins.clear();
  ASSERT_TRUE(reg->Unregister("layers", "", kOwner).ok());
  EXPECT_EQ(engine.live, 0);
}

TEST(CudaRegionSet, CallsNameAMemberBySetAndIndexWithItsBoundsChecked) {
  Engine engine;
  auto reg = Registry(engine);
  ASSERT_TRUE(reg->RegisterCudaSet("layers", Layers(), 0, "c", kOwner).ok());
  std::vector<RegionPin> pins;
  absl::StatusOr<RegionRange> r = reg->Resolve(
      "kv_pool", RegionKind::kCudaIpc, RegionName{"", "layers", 60}, 0, 4096, &pins, kOwner);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->label, "layers[60]");
  EXPECT_EQ(reg->ListSets()[0].in_use, 1);

  r = reg->Resolve("kv_pool", RegionKind::kCudaIpc, RegionName{"", "layers", 61}, 0, 64, &pins,
                   kOwner);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "kv_pool: index 61 is out of range for region set 'layers' (61 members, 0 to 60)");
  r = reg->Resolve("q", RegionKind::kCudaIpc, RegionName{"", "layers", 1}, 4096, 8192, &pins,
                   kOwner);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "q: offset 4096 + byte_size 8192 is past the end of member 1 of region set 'layers' "
            "(8192 bytes)");
  r = reg->Resolve("q", RegionKind::kCudaIpc, RegionName{"", "layers", 1}, 8, 16, &pins, kOwner);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("is not a multiple of 16"));
  // A cuda_ipc set is not found as shm, nor as a region alone.
  r = reg->Resolve("kv_pool", RegionKind::kShm, RegionName{"", "layers", 0}, 0, 64, &pins, kOwner);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  r = reg->Resolve("kv_pool", RegionKind::kCudaIpc, RegionName{"layers", "", 0}, 0, 64, &pins,
                   kOwner);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST(CudaRegionSet, EveryMemberCountsAgainstBothLimits) {
  Engine engine;
  RegionLimits limits;
  limits.max_regions = 130;
  limits.max_regions_per_client = 64;
  auto reg = Registry(engine, limits);
  ASSERT_TRUE(reg->RegisterCudaSet("rank0", Layers(), 0, "c0", Process(10)).ok());
  // The same process: 61 + 61 > 64.
  absl::StatusOr<RegionSetSummary> s =
      reg->RegisterCudaSet("rank0b", Layers(), 0, "c0", Process(10));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.status().message(),
            "name: client " + Process(10).label +
                " has 61 regions registered (set members included) and "
                "this set adds 61, the most --max_regions_per_client (64) allows");
  // Up to the limit, counted with a shm region of the same owner: 61 + 3 = 64.
  EXPECT_TRUE(reg->RegisterCudaSet("rank0c", Layers(3), 0, "c0", Process(10)).ok());
  s = reg->RegisterCudaSet("rank0d", Layers(1), 0, "c0", Process(10));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  // Another process has room of its own, until the daemon-wide limit: 64 + 61 + 6 > 130.
  ASSERT_TRUE(reg->RegisterCudaSet("rank1", Layers(), 0, "c1", Process(11)).ok());
  s = reg->RegisterCudaSet("rank2", Layers(6), 0, "c2", Process(12));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("125 regions are registered (set members included) and this set adds 6, "
                        "more than --max_regions (130) allows"));
  EXPECT_EQ(reg->count(), 125);
  EXPECT_EQ(engine.live, 125);
  // Unregistering by client frees that client's members.
  ASSERT_TRUE(reg->Unregister("", "c0", kOwner).ok());
  EXPECT_EQ(reg->count(), 61);
  EXPECT_TRUE(reg->RegisterCudaSet("rank2", Layers(6), 0, "c2", Process(12)).ok());
}

TEST(CudaRegionSet, ASetAndARegionShareOneNamespace) {
  Engine engine;
  auto reg = Registry(engine);
  ASSERT_TRUE(reg->RegisterCuda("pool", Handle(1), 0, 4096, "c", kOwner).ok());
  absl::StatusOr<RegionSetSummary> s = reg->RegisterCudaSet("pool", Layers(2), 0, "c", kOwner);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(reg->RegisterCudaSet("layers", Layers(2), 0, "c", kOwner).ok());
  EXPECT_EQ(reg->RegisterCuda("layers", Handle(1), 0, 4096, "c", kOwner).status().code(),
            absl::StatusCode::kAlreadyExists);
  s = reg->RegisterCudaSet("", Layers(2), 0, "c", kOwner);
  EXPECT_EQ(s.status().message(), "name: must have 1 to 128 characters");
  s = reg->RegisterCudaSet("empty", {}, 0, "c", kOwner);
  EXPECT_EQ(s.status().message(), "members: a region set needs at least one member");
}

// The shm sets go through the same set logic: a bad member registers nothing, named by field.
TEST(ShmRegionSet, AMemberThatFailsRegistersNothingAndIsNamedByItsField) {
  const std::string key = absl::StrCat("/verifyd_test_sets_", ::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_RDWR | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 8192), 0);
  ::close(fd);
  RegionRegistry reg(RegionLimits{}, nullptr);
  std::vector<ShmSetMember> members = {{key, 0, 4096}, {key, 4096, 4096}, {key, 8, 64}};
  absl::StatusOr<RegionSetSummary> s = reg.RegisterShmSet("layers", members, "c", kOwner);
  EXPECT_THAT(std::string(s.status().message()), StartsWith("members[2].offset: 8 is not"));
  members[2] = {key, 4096, 8192};
  s = reg.RegisterShmSet("layers", members, "c", kOwner);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), StartsWith("members[2].byte_size: "));
  EXPECT_EQ(reg.count(), 0);
  members.pop_back();
  s = reg.RegisterShmSet("layers", members, "c", kOwner);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->device, -1);
  EXPECT_EQ(reg.count(), 2);
  ::shm_unlink(key.c_str());
}

}  // namespace
}  // namespace verifyd
