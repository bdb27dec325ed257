// Who may use what in the registry: a region and a set belong to the peer that registered them,
// and another peer may use, list or unregister them only as --region_sharing allows; each refusal
// is PERMISSION_DENIED naming the field and the region, and reported. A uid holds at most
// max_regions_per_uid. What a process registered goes when the process exits (a real child,
// killed with SIGKILL).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "src/region/region_registry.h"
#include "tests/region/fake_device_memory.h"

namespace verifyd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

struct Fixture {
  int live = 0;
  std::vector<Denial> denials;  // what was reported (caller copied into caller_label)
  std::vector<std::string> denied_callers;
  std::unique_ptr<RegionRegistry> reg;

  explicit Fixture(RegionLimits limits = {}) {
    reg = std::make_unique<RegionRegistry>(
        limits,
        [this](int device, const std::string&,
               uint64_t bytes) -> absl::StatusOr<std::unique_ptr<MappedRegion>> {
          return std::unique_ptr<MappedRegion>(new FakeDeviceMemory(device, bytes, &live));
        });
    reg->SetDenialObserver([this](const Denial& d) {
      denials.push_back(d);
      denied_callers.push_back(d.caller->label);
    });
  }
  absl::Status Register(const std::string& name, const std::string& client, const Peer& by) {
    return reg->RegisterCuda(name, Handle(name.size() % 10), 0, 4096, client, by).status();
  }
  absl::Status Use(const std::string& name, const Peer& caller) {
    std::vector<RegionPin> pins;
    return reg->Resolve("kv_pool", RegionKind::kCudaIpc, name, 0, 64, &pins, caller).status();
  }
  absl::Status UseMember(const std::string& set, uint32_t i, const Peer& caller) {
    std::vector<RegionPin> pins;
    return reg
        ->Resolve("kv_pool", RegionKind::kCudaIpc, RegionName{"", set, i}, 0, 64, &pins, caller)
        .status();
  }
};

const Peer kAlice = Peer::Unix(1000, 41);
const Peer kAliceRank1 = Peer::Unix(1000, 42);
const Peer kMallory = Peer::Unix(65534, 43);

TEST(RegionTenancy, AnotherUidCanNeitherUseNorUnregisterNorListARegion) {
  Fixture f;
  ASSERT_TRUE(f.Register("pool", "rank0", kAlice).ok());

  absl::Status st = f.Use("pool", kMallory);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_THAT(std::string(st.message()),
              StartsWith("kv_pool: region 'pool' belongs to uid 1000 pid 41, not to the caller "
                         "(uid 65534 pid 43)"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("--region_sharing=uid"));

  st = f.reg->Unregister("pool", "", kMallory).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_THAT(std::string(st.message()), StartsWith("name: region 'pool' belongs to uid 1000"));

  // By client name: the client name is anyone's to claim; Alice's regions stay.
  absl::StatusOr<std::vector<std::string>> gone = f.reg->Unregister("", "rank0", kMallory);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_TRUE(gone->empty());

  EXPECT_TRUE(f.reg->List(&kMallory).empty());
  EXPECT_EQ(f.reg->List(&kAlice).size(), 1u);
  EXPECT_EQ(f.reg->List().size(), 1u);  // the operator's view
  EXPECT_EQ(f.reg->count(), 1);
  EXPECT_EQ(f.live, 1);
  EXPECT_TRUE(f.Use("pool", kAlice).ok());

  ASSERT_EQ(f.denials.size(), 2u);
  EXPECT_STREQ(f.denials[0].resource, "region");
  EXPECT_EQ(f.denials[0].what, "region 'pool'");
  EXPECT_EQ(f.denials[0].action, "use");
  EXPECT_EQ(f.denials[0].owner, "uid 1000 pid 41");
  EXPECT_EQ(f.denied_callers[0], "uid 65534 pid 43");
  EXPECT_EQ(f.denials[1].action, "unregister");
}

TEST(RegionTenancy, ASetIsOwnedWholeAndEachMemberIsRefusedToAnotherUid) {
  Fixture f;
  std::vector<CudaSetMember> members(3);
  for (int i = 0; i < 3; ++i) {
    members[i].ipc_handle = Handle(i);
    members[i].byte_size = 4096;
  }
  ASSERT_TRUE(f.reg->RegisterCudaSet("layers", members, 0, "rank0", kAlice).ok());
  for (uint32_t i = 0; i < 3; ++i) {
    absl::Status st = f.UseMember("layers", i, kMallory);
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
    EXPECT_THAT(std::string(st.message()), StartsWith("kv_pool: region set 'layers' belongs to"));
    EXPECT_TRUE(f.UseMember("layers", i, kAliceRank1).ok());
  }
  // The member index is not checked before ownership: another uid learns nothing of the set.
  EXPECT_EQ(f.UseMember("layers", 99, kMallory).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(f.reg->ListSets(&kMallory).empty());
  EXPECT_EQ(f.reg->Unregister("layers", "", kMallory).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(f.reg->Unregister("", "rank0", kMallory)->empty());
  EXPECT_EQ(f.reg->count(), 3);
  absl::StatusOr<std::vector<std::string>> gone = f.reg->Unregister("", "rank0", kAliceRank1);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(*gone, std::vector<std::string>{"layers"});
  EXPECT_EQ(f.live, 0);
}

TEST(RegionTenancy, SharingDecidesWhoElseMayUseARegion) {
  {
    Fixture f;  // uid, the default: every process of the uid
    ASSERT_TRUE(f.Register("pool", "rank0", kAlice).ok());
    EXPECT_TRUE(f.Use("pool", kAliceRank1).ok());
    EXPECT_TRUE(f.Use("pool", Peer::Unix(1000, std::nullopt)).ok());
    EXPECT_EQ(f.Use("pool", Peer{}).code(), absl::StatusCode::kPermissionDenied);  // unverified
    EXPECT_EQ(f.Use("pool", Peer::Tcp("rank0")).code(), absl::StatusCode::kPermissionDenied);
    EXPECT_TRUE(f.Use("pool", Peer::Daemon()).ok());  // verifyd's own probes
  }
  {
    RegionLimits l;
    l.sharing = Sharing::kProcess;
    Fixture f(l);
    ASSERT_TRUE(f.Register("pool", "rank0", kAlice).ok());
    EXPECT_TRUE(f.Use("pool", kAlice).ok());
    absl::Status st = f.Use("pool", kAliceRank1);
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(std::string(st.message()), HasSubstr("only the registering process"));
    // A process whose pid verifyd cannot see (another pid namespace) is not the registering one.
    EXPECT_EQ(f.Use("pool", Peer::Unix(1000, std::nullopt)).code(),
              absl::StatusCode::kPermissionDenied);
    EXPECT_TRUE(f.reg->Unregister("", "rank0", kAliceRank1)->empty());
    EXPECT_EQ(f.reg->Unregister("", "rank0", kAlice)->size(), 1u);
  }
  {
    RegionLimits l;
    l.sharing = Sharing::kAll;
    Fixture f(l);
    ASSERT_TRUE(f.Register("pool", "rank0", kAlice).ok());
    EXPECT_TRUE(f.Use("pool", kMallory).ok());
    EXPECT_EQ(f.reg->List(&kMallory).size(), 1u);
    EXPECT_TRUE(f.denials.empty());
  }
  {
    Fixture f;  // TCP callers (--allow_region_tcp) are one tenant, apart from the socket's
    ASSERT_TRUE(f.Register("pool", "rank0", Peer::Tcp("rank0")).ok());
    EXPECT_TRUE(f.Use("pool", Peer::Tcp("anyone")).ok());
    EXPECT_EQ(f.Use("pool", kAlice).code(), absl::StatusCode::kPermissionDenied);
  }
}

TEST(RegionTenancy, OneUidCannotFillTheDaemon) {
  RegionLimits l;
  l.max_regions = 10;
  l.max_regions_per_client = 2;
  l.max_regions_per_uid = 4;
  Fixture f(l);
  // Eight short-lived processes of one uid, two regions each: the uid's cap stops them at 4.
  int ok = 0;
  absl::Status refused;
  for (int p = 0; p < 8; ++p) {
    for (int r = 0; r < 2; ++r) {
      absl::Status st = f.Register("m" + std::to_string(p * 2 + r), "c" + std::to_string(p),
                                   Peer::Unix(65534, 100 + p));
      if (st.ok()) {
        ++ok;
      } else {
        refused = st;
      }
    }
  }
  EXPECT_EQ(ok, 4);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--max_regions_per_uid"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("uid 65534"));
  EXPECT_EQ(f.reg->count_of_uid(65534), 4);
  // Another user still registers.
  EXPECT_TRUE(f.Register("alice0", "a", kAlice).ok());
  EXPECT_TRUE(f.Register("alice1", "a", kAlice).ok());
  EXPECT_EQ(f.reg->count_of_uid(1000), 2);
  // Unregistering gives the uid its room back.
  ASSERT_TRUE(f.reg->Unregister("m0", "", Peer::Unix(65534, 100)).ok());
  EXPECT_EQ(f.reg->count_of_uid(65534), 3);
  EXPECT_TRUE(f.Register("again", "c9", Peer::Unix(65534, 109)).ok());
}

// A child that waits to be killed; its pid names the registering process.
pid_t Sleeper() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (;;) ::pause();
  }
  return pid;
}

TEST(RegionTenancy, WhatAProcessRegisteredGoesWhenItIsKilled) {
  RegionLimits l;
  l.reap_every = absl::Milliseconds(20);
  Fixture f(l);
  const pid_t dying = Sleeper();
  const pid_t living = Sleeper();
  ASSERT_GT(dying, 0);
  ASSERT_GT(living, 0);
  const Peer d = Peer::Unix(1000, dying);
  ASSERT_TRUE(f.Register("d0", "dying", d).ok());
  ASSERT_TRUE(f.Register("d1", "dying", d).ok());
  std::vector<CudaSetMember> members(2);
  for (int i = 0; i < 2; ++i) {
    members[i].ipc_handle = Handle(3 + i);
    members[i].byte_size = 4096;
  }
  ASSERT_TRUE(f.reg->RegisterCudaSet("dset", members, 0, "dying", d).ok());
  ASSERT_TRUE(f.Register("l0", "living", Peer::Unix(1000, living)).ok());
  // A call in flight holds a region of the dying process: its mapping outlives the reap.
  std::vector<RegionPin> pins;
  ASSERT_TRUE(f.reg->Resolve("kv_pool", RegionKind::kCudaIpc, "d0", 0, 64, &pins, d).ok());
  EXPECT_EQ(f.reg->count(), 5);
  EXPECT_EQ(f.live, 5);

  ASSERT_EQ(::kill(dying, SIGKILL), 0);
  ASSERT_EQ(::waitpid(dying, nullptr, 0), dying);
  const auto t0 = std::chrono::steady_clock::now();
  while (f.reg->count() != 1 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(f.reg->count(), 1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  ASSERT_EQ(f.reg->List().size(), 1u);
  EXPECT_EQ(f.reg->List()[0].name, "l0");
  EXPECT_TRUE(f.reg->ListSets().empty());
  EXPECT_EQ(f.reg->count_of_uid(1000), 1);
  EXPECT_EQ(f.live, 2);  // the pinned region and the living one
  pins.clear();
  EXPECT_EQ(f.live, 1);
  // The name is free again.
  EXPECT_TRUE(f.Register("d0", "next", Peer::Unix(1000, living)).ok());

  ::kill(living, SIGKILL);
  ::waitpid(living, nullptr, 0);
}

}  // namespace
}  // namespace verifyd
