// Registered shared-memory regions end to end over a Unix socket: inputs read in place and
// outputs written in place give the inline transport's bytes; the shadow path is safe from a
// client that reuses its buffers after the response; every bad reference gets a clear error
// naming the field and the daemon keeps serving; an unregister waits for the calls that use the
// region; regions are refused over TCP; limits, listing, metrics and status.

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/algorithm/container.h"
#include "grpcpp/create_channel_posix.h"
#include "src/region/shm_mapping.h"
#include "tests/service/daemon_fixture.h"
#include "tests/service/peer_process.h"
#include "tests/service/shm_region_fixture.h"

namespace verifyd::testing {
namespace {

using Clock = std::chrono::steady_clock;

class RegionTest : public DaemonTest {
 protected:
  // `max_regions` and `per_client` -1: the defaults.
  void Start(bool allow_tcp = false, int64_t max_regions = 64, int64_t per_client = -1) {
    dir_ = TestDir("region");
    DaemonOptions o = TestOptions(dir_);
    o.allow_region_tcp = allow_tcp;
    if (max_regions >= 0) o.regions.max_regions = max_regions;
    if (per_client >= 0) o.regions.max_regions_per_client = per_client;
    o.regions.max_total_bytes = uint64_t{1} << 30;
    o.handler.oracle_sample_rate = 0;
    StartDaemon(std::move(o));
    unix_ = v1::VerifyService::NewStub(Channel(daemon_->listen_addresses()[1]));
  }
  grpc::Status RegisterShm(const std::string& name, const ShmObject& shm, uint64_t offset = 0,
                           uint64_t bytes = 0, const std::string& client = "",
                           v1::VerifyService::Stub* via = nullptr) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name);
    req.set_key(shm.key());
    req.set_offset(offset);
    req.set_byte_size(bytes ? bytes : shm.size() - offset);
    req.set_client(client);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return (via ? via : unix_.get())->RegisterShmRegion(&ctx, req, &resp);
  }
  grpc::Status Unregister(const std::string& name, const std::string& client = "",
                          v1::UnregisterRegionResponse* out = nullptr) {
    v1::UnregisterRegionRequest req;
    req.set_name(name);
    req.set_client(client);
    v1::UnregisterRegionResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = unix_->UnregisterRegion(&ctx, req, &resp);
    if (out) *out = resp;
    return st;
  }
  // Registers set `name` of members (key, offset, byte_size).
  grpc::Status RegisterSet(const std::string& name,
                           const std::vector<std::tuple<std::string, uint64_t, uint64_t>>& members,
                           const std::string& client = "", v1::VerifyService::Stub* via = nullptr,
                           v1::RegisterRegionSetResponse* out = nullptr) {
    v1::RegisterShmRegionSetRequest req;
    req.set_name(name);
    req.set_client(client);
    for (const auto& [key, offset, bytes] : members) {
      v1::ShmRegionSetMember* m = req.add_members();
      m->set_key(key);
      m->set_offset(offset);
      m->set_byte_size(bytes);
    }
    v1::RegisterRegionSetResponse resp;
    grpc::ClientContext ctx;
    grpc::Status st = (via ? via : unix_.get())->RegisterShmRegionSet(&ctx, req, &resp);
    if (out) *out = resp;
    return st;
  }
  v1::ListRegionsResponse List() {
    v1::ListRegionsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(unix_->ListRegions(&ctx, v1::ListRegionsRequest(), &resp).ok());
    return resp;
  }
  grpc::Status VerifyUnix(const v1::VerifyRequest& req, v1::VerifyResponse* resp) {
    grpc::ClientContext ctx;
    return unix_->Verify(&ctx, req, resp);
  }
  std::string dir_;
  std::unique_ptr<v1::VerifyService::Stub> unix_;
};

// Inline and shm transports serve the same bytes, served by the reference (shadow) and by the
// custom path (custom mode), on odd sizes and page sizes 1 and 16.
TEST_F(RegionTest, ShmMatchesInlineBitForBit) {
  Start();
  ShmObject shm("bitwise", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  for (v1::Mode mode : {v1::MODE_SHADOW, v1::MODE_CUSTOM}) {
    if (mode == v1::MODE_CUSTOM) {
      ASSERT_TRUE(SetMode(mode, /*force=*/true).ok());
    }
    for (auto [seed, page, draft, prefix] :
         {std::tuple{11u, 1, 5, 37}, std::tuple{12u, 16, 7, 131}, std::tuple{13u, 16, 1, 0}}) {
      RandomBundle b(RegionBundleSpec(seed, page, draft, prefix));
      v1::VerifyRequest inline_req;
      EncodeRequest(b.view(), &inline_req);
      inline_req.set_want_lse(true);
      v1::VerifyResponse want;
      ASSERT_TRUE(VerifyUnix(inline_req, &want).ok());

      v1::VerifyRequest req = inline_req;
      const ShmLayout l = ShmLayout::Of(b.view(), 4096);
      ASSERT_LE(l.end, shm.size());
      std::memset(shm.data() + l.o, 0xAB, l.end - l.o);
      PutInShm(b.view(), l, shm.data(), "pool", &req);
      v1::VerifyResponse got;
      grpc::Status st = VerifyUnix(req, &got);
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_FALSE(got.has_o()) << "the output went to the region, not the response";
      EXPECT_FALSE(got.has_lse());
      EXPECT_EQ(got.served_path(), want.served_path());
      ASSERT_EQ(want.o().raw_contents().size(), b.view().o_elems() * 2);
      EXPECT_EQ(std::memcmp(shm.data() + l.o, want.o().raw_contents().data(),
                            want.o().raw_contents().size()),
                0)
          << "o differs, seed " << seed;
      EXPECT_EQ(std::memcmp(shm.data() + l.lse, want.lse().raw_contents().data(),
                            want.lse().raw_contents().size()),
                0)
          << "lse differs, seed " << seed;

      // Inputs in the region, output back in the response.
      req.clear_o_out();
      req.clear_lse_out();
      v1::VerifyResponse back;
      ASSERT_TRUE(VerifyUnix(req, &back).ok());
      EXPECT_EQ(back.o().raw_contents(), want.o().raw_contents());
      EXPECT_EQ(back.lse().raw_contents(), want.lse().raw_contents());
    }
  }
  const v1::ListRegionsResponse list = List();
  ASSERT_EQ(list.regions_size(), 1);
  EXPECT_EQ(list.regions(0).calls(), 12);
  EXPECT_EQ(list.regions(0).in_use(), 0);
}

// The shadow hazard: the other path and the comparison run after the response, when the client
// may already reuse its buffers. verifyd copies what they read first, so garbage written into q
// and the pool right after each response changes nothing: every comparison stays clean.
TEST_F(RegionTest, ShadowIsCleanWhenTheClientReusesItsBuffers) {
  Start();
  ShmObject shm("hazard", 16 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  ASSERT_EQ(Status().mode(), v1::MODE_SHADOW);
  constexpr int kCalls = 6;
  for (int i = 0; i < kCalls; ++i) {
    RandomBundle b(RegionBundleSpec(100 + i, i % 2 ? 1 : 16, 6, 300));
    v1::VerifyRequest req;
    EncodeRequest(b.view(), &req);
    const ShmLayout l = ShmLayout::Of(b.view());
    PutInShm(b.view(), l, shm.data(), "pool", &req);
    v1::VerifyResponse resp;
    ASSERT_TRUE(VerifyUnix(req, &resp).ok());
    // The client reuses q and the pages at once: NaN everywhere.
    std::memset(shm.data() + l.q, 0xFF, l.kv_indptr - l.q);
  }
  const v1::Counters c = WaitForComparisons(kCalls);
  EXPECT_EQ(c.comparisons_match(), kCalls);
  EXPECT_EQ(c.comparisons_breach(), 0);
  EXPECT_EQ(c.comparisons_error(), 0);
}

// A pool registered once and larger than any call: calls name scattered pages of it.
TEST_F(RegionTest, ACallReadsOnlyItsPagesOfAPool) {
  Start();
  RandomBundle b(RegionBundleSpec(7, 16, 4, 200));
  const BundleView& v = b.view();
  const size_t page_bytes = size_t(v.shape.page_size) * kernels::kHeadDimQK * 2;
  // The client's pool: 4x the pages, the bundle's pages at page 3*k+1, NaN elsewhere.
  const int64_t pool_pages = v.shape.num_pages * 4;
  ShmObject shm("bigpool", pool_pages * page_bytes);
  std::memset(shm.data(), 0xFF, shm.size());
  std::vector<int32_t> indices(v.kv_indices, v.kv_indices + v.shape.num_indices);
  for (int32_t& p : indices) {
    const int32_t to = 3 * p + 1;
    std::memcpy(shm.data() + to * page_bytes, static_cast<const char*>(v.kv_pool) + p * page_bytes,
                page_bytes);
    p = to;
  }
  ASSERT_TRUE(RegisterShm("kv", shm).ok());
  v1::VerifyRequest inline_req;
  EncodeRequest(v, &inline_req);
  v1::VerifyResponse want;
  ASSERT_TRUE(VerifyUnix(inline_req, &want).ok());
  v1::VerifyRequest req = inline_req;
  req.mutable_kv_pool()->set_shape(0, pool_pages);
  SetShm(req.mutable_kv_pool(), "kv", 0, shm.size());
  req.mutable_kv_indices()->set_raw_contents(indices.data(), indices.size() * 4);
  v1::VerifyResponse got;
  grpc::Status st = VerifyUnix(req, &got);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(got.o().raw_contents(), want.o().raw_contents());
  const v1::Counters c = WaitForComparisons(2);
  EXPECT_EQ(c.comparisons_match(), 2);
}

struct BadRef {
  std::string name;
  std::function<void(v1::VerifyRequest*)> mutate;
  grpc::StatusCode code;
  std::string field;  // the error names it
};

TEST_F(RegionTest, BadReferencesNameTheFieldAndServingGoesOn) {
  Start();
  ShmObject shm("bad", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm, 0, 4 << 20).ok());
  ASSERT_TRUE(RegisterShm("ids", shm, 6 << 20, 1 << 20).ok());
  RandomBundle b(RegionBundleSpec(21, 16, 4, 90));
  const ShmLayout l = ShmLayout::Of(b.view());
  v1::VerifyRequest good;
  EncodeRequest(b.view(), &good);
  PutInShm(b.view(), l, shm.data(), "pool", &good);
  const uint64_t page_bytes = 16 * 576 * 2;
  const std::vector<BadRef> cases = {
      {"unknown region", [](auto* r) { r->mutable_q()->mutable_shm()->set_region("nope"); },
       grpc::StatusCode::NOT_FOUND, "q:"},
      {"past the end",
       [](auto* r) { r->mutable_kv_lens()->mutable_shm()->set_offset((4 << 20) - 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_lens:"},
      {"kv_pool offset off the 16-byte grid",
       [](auto* r) {
         r->mutable_kv_pool()->mutable_shm()->set_offset(r->kv_pool().shm().offset() + 2);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_pool: offset"},
      {"q offset off the 16-byte grid",
       [](auto* r) { r->mutable_q()->mutable_shm()->set_offset(r->q().shm().offset() + 8); },
       grpc::StatusCode::INVALID_ARGUMENT, "q: offset"},
      {"offset overflow",
       [](auto* r) { r->mutable_kv_indptr()->mutable_shm()->set_offset(~uint64_t{0} - 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_indptr:"},
      {"byte size vs shape",
       [](auto* r) { r->mutable_q()->mutable_shm()->set_byte_size(r->q().shm().byte_size() - 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "q:"},
      {"pool not whole pages",
       [&](auto* r) {
         r->mutable_kv_pool()->mutable_shm()->set_byte_size(r->kv_pool().shm().byte_size() +
                                                            page_bytes / 2);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_pool:"},
      {"page id past the pool",
       [&](auto* r) {
         int32_t* ids = reinterpret_cast<int32_t*>(shm.data() + (6 << 20));
         std::memcpy(ids, b.view().kv_indices, b.view().shape.num_indices * 4);
         ids[1] = static_cast<int32_t>(b.view().shape.num_pages);
         r->mutable_kv_indices()->mutable_shm()->set_region("ids");
         r->mutable_kv_indices()->mutable_shm()->set_offset(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "kv_indices[1]:"},
      {"o_out inline", [](auto* r) { r->mutable_o_out()->set_raw_contents("x"); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_out:"},
      {"o_out shape", [](auto* r) { r->mutable_o_out()->set_shape(1, 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_out:"},
      {"o_out past the end",
       [](auto* r) { r->mutable_o_out()->mutable_shm()->set_offset(4 << 20); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_out:"},
      {"o_out over kv_pool",
       [](auto* r) { r->mutable_o_out()->mutable_shm()->set_offset(r->kv_pool().shm().offset()); },
       grpc::StatusCode::INVALID_ARGUMENT, "o_out: bytes"},
      {"o_out over the end of q",
       [](auto* r) {
         r->mutable_o_out()->mutable_shm()->set_offset(r->q().shm().offset() +
                                                       r->q().shm().byte_size() - 16);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "o_out: bytes"},
      {"lse_out over o_out",
       [](auto* r) {
         r->set_want_lse(true);
         *r->mutable_lse_out() = r->o_out();
         r->mutable_lse_out()->clear_shape();
         r->mutable_lse_out()->add_shape(r->o_out().shape(0));
         r->mutable_lse_out()->add_shape(r->o_out().shape(1));
         r->mutable_lse_out()->set_dtype(v1::DTYPE_F32);
         r->mutable_lse_out()->mutable_shm()->set_byte_size(r->o_out().shape(0) *
                                                            r->o_out().shape(1) * 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "lse_out: bytes"},
      {"lse_out without want_lse", [](auto* r) { *r->mutable_lse_out() = r->o_out(); },
       grpc::StatusCode::INVALID_ARGUMENT, "lse_out:"},
      {"cuda_ipc region unknown",
       [](auto* r) {
         auto* t = r->mutable_kv_pool();
         const auto ref = t->shm();
         t->mutable_cuda_ipc()->set_region(ref.region());
         t->mutable_cuda_ipc()->set_offset(ref.offset());
         t->mutable_cuda_ipc()->set_byte_size(ref.byte_size());
       },
       grpc::StatusCode::NOT_FOUND, "kv_pool:"},
  };
  for (const BadRef& c : cases) {
    v1::VerifyRequest req = good;
    c.mutate(&req);
    v1::VerifyResponse resp;
    grpc::Status st = VerifyUnix(req, &resp);
    EXPECT_EQ(st.error_code(), c.code) << c.name << ": " << st.error_message();
    EXPECT_EQ(st.error_message().rfind(c.field, 0), 0u)
        << c.name << ": the error names the field: " << st.error_message();
    v1::VerifyResponse ok;
    ASSERT_TRUE(VerifyUnix(good, &ok).ok()) << "still serving after " << c.name;
  }
}

// A client that shrinks its shm object under a registered region: the calls that read it are
// refused naming the region (no SIGBUS takes the daemon down), and other regions and inline
// calls go on being served.
TEST_F(RegionTest, AShrunkObjectFailsItsCallsAndServingGoesOn) {
  Start();
  ShmObject shm("shrink", 8 << 20);
  ShmObject other("intact", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  ASSERT_TRUE(RegisterShm("other", other).ok());
  RandomBundle b(RegionBundleSpec(31, 16, 4, 90));
  const ShmLayout l = ShmLayout::Of(b.view());
  v1::VerifyRequest inline_req;
  EncodeRequest(b.view(), &inline_req);
  v1::VerifyRequest in_pool = inline_req, in_other = inline_req;
  PutInShm(b.view(), l, shm.data(), "pool", &in_pool);
  PutInShm(b.view(), l, other.data(), "other", &in_other);
  v1::VerifyResponse first;
  ASSERT_TRUE(VerifyUnix(in_pool, &first).ok());
  {  // the owner truncates its object; the test's own mapping is not read after this
    const int fd = shm_open(shm.key().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 0), 0);
    close(fd);
  }
  // The call that meets the lost pages, then calls refused before they read.
  for (int i = 0; i < 3; ++i) {
    v1::VerifyResponse r;
    grpc::Status st = VerifyUnix(in_pool, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << i << ": " << st.error_message();
    EXPECT_NE(st.error_message().find("region 'pool' lost its memory"), std::string::npos)
        << i << ": " << st.error_message();
  }
  const v1::ListRegionsResponse listed = List();
  ASSERT_EQ(listed.regions_size(), 2);
  for (const v1::RegionInfo& r : listed.regions()) {
    EXPECT_EQ(r.lost(), r.name() == "pool") << r.name();
  }
  v1::VerifyResponse inline_resp, other_resp;
  ASSERT_TRUE(VerifyUnix(inline_req, &inline_resp).ok());
  ASSERT_TRUE(VerifyUnix(in_other, &other_resp).ok());
  const size_t o_bytes = b.view().o_elems() * 2;
  EXPECT_EQ(std::memcmp(other.data() + l.o, inline_resp.o().raw_contents().data(), o_bytes), 0);
  EXPECT_TRUE(Unregister("pool").ok());
  ShmObject again("shrink2", 8 << 20);
  ASSERT_TRUE(RegisterShm("pool", again).ok());
  PutInShm(b.view(), l, again.data(), "pool", &in_pool);
  v1::VerifyResponse r;
  EXPECT_TRUE(VerifyUnix(in_pool, &r).ok());
  const v1::ListRegionsResponse relisted = List();
  for (const v1::RegionInfo& info : relisted.regions()) EXPECT_FALSE(info.lost()) << info.name();
  EXPECT_EQ(std::memcmp(again.data() + l.o, inline_resp.o().raw_contents().data(), o_bytes), 0);
}

TEST_F(RegionTest, BadRegistrationsNameTheField) {
  Start(false, 2);
  ShmObject shm("reg", 1 << 20);
  grpc::Status st = RegisterShm("a", shm, 0, (1 << 20) + 1);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("byte_size:", 0), 0u) << st.error_message();
  st = RegisterShm("a", shm, 4100, 4096);  // inside the object, off the 16-byte grid
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("offset: 4100 is not a multiple of 16", 0), 0u)
      << st.error_message();
  {
    v1::RegisterShmRegionRequest req;
    req.set_name("a");
    req.set_key("/vdtest-no-such-object");
    req.set_byte_size(64);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    st = unix_->RegisterShmRegion(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_EQ(st.error_message().rfind("key:", 0), 0u) << st.error_message();
  }
  {
    v1::RegisterCudaRegionRequest req;
    req.set_name("g");
    req.set_ipc_handle(std::string(64, '\0'));
    req.set_byte_size(64);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    st = unix_->RegisterCudaRegion(&ctx, req, &resp);
    if (TestEngine() == "cpu") {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    } else {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    }
    EXPECT_EQ(st.error_message().rfind("ipc_handle:", 0), 0u) << st.error_message();
  }
  ASSERT_TRUE(RegisterShm("a", shm, 0, 4096, "c1").ok());
  st = RegisterShm("a", shm, 0, 4096, "c1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
  ASSERT_TRUE(RegisterShm("b", shm, 4096, 4096, "c1").ok());
  st = RegisterShm("c", shm, 8192, 4096, "c2");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();

  // Listing, status and metrics show them.
  const v1::ListRegionsResponse list = List();
  ASSERT_EQ(list.regions_size(), 2);
  EXPECT_EQ(list.total_bytes(), 8192u);
  EXPECT_EQ(list.max_regions(), 2);
  EXPECT_EQ(list.regions(0).shm_key(), shm.key());
  EXPECT_EQ(Status().regions_size(), 2);
  const std::string metrics = Scrape(daemon_->metrics_port());
  EXPECT_NE(metrics.find("verifyd_regions 2"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("verifyd_region_bytes 8192"), std::string::npos);

  // An empty name unregisters all of one client's regions.
  v1::UnregisterRegionResponse out;
  ASSERT_TRUE(Unregister("", "c1", &out).ok());
  EXPECT_EQ(out.unregistered_size(), 2);
  EXPECT_EQ(List().regions_size(), 0);
  st = Unregister("a");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_regions 0"), std::string::npos);
}

// Regions are memory on the daemon's host: over TCP they are refused unless allowed.
TEST_F(RegionTest, RefusedOverTcpByDefault) {
  Start();
  ShmObject shm("tcp", 4 << 20);
  grpc::Status st = RegisterShm("pool", shm, 0, 0, "", verify_.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  // The error names the safe fix (the Unix socket), not the insecure option.
  EXPECT_NE(st.error_message().find("--listen=unix:PATH"), std::string::npos) << st.error_message();
  EXPECT_EQ(st.error_message().find("--allow_region_tcp"), std::string::npos) << st.error_message();
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  RandomBundle b(RegionBundleSpec(31, 16, 3, 40));
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  PutInShm(b.view(), ShmLayout::Of(b.view()), shm.data(), "pool", &req);
  v1::VerifyResponse resp;
  st = Verify(req, &resp);  // TCP
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("q:", 0), 0u) << st.error_message();
  EXPECT_TRUE(VerifyUnix(req, &resp).ok());
}

TEST_F(RegionTest, ServedOverTcpWithTheFlag) {
  Start(/*allow_tcp=*/true);
  ShmObject shm("tcpok", 4 << 20);
  ASSERT_TRUE(RegisterShm("pool", shm, 0, 0, "", verify_.get()).ok());
  RandomBundle b(RegionBundleSpec(32, 16, 3, 40));
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  PutInShm(b.view(), ShmLayout::Of(b.view()), shm.data(), "pool", &req);
  v1::VerifyResponse resp;
  grpc::Status st = Verify(req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

// A client names shm objects by key, and verifyd maps them read-write: only an object the
// caller owns (any, for root) is mapped, so that no client can have verifyd read or write
// another user's memory. Independent of who runs the test.
TEST(ShmMapping, MapsOnlyTheCallersOwnObjects) {
  ShmObject shm("owner", 1 << 20);
  const uint32_t me = ::getuid();
  const uint32_t other = me == 0 ? 65534 : me + 1;
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = MapShm(shm.key(), 0, shm.size(), other);
  ASSERT_EQ(m.status().code(), absl::StatusCode::kPermissionDenied) << m.status();
  const std::string msg(m.status().message());
  EXPECT_EQ(msg.rfind("key:", 0), 0u) << msg;
  EXPECT_NE(msg.find("belongs to uid " + std::to_string(me)), std::string::npos) << msg;
  EXPECT_NE(msg.find("(uid " + std::to_string(other) + ")"), std::string::npos) << msg;
  EXPECT_TRUE(MapShm(shm.key(), 0, shm.size(), me).ok());
  EXPECT_TRUE(MapShm(shm.key(), 0, shm.size(), 0u).ok());            // root
  EXPECT_TRUE(MapShm(shm.key(), 0, shm.size(), std::nullopt).ok());  // TCP: nobody known
}

// An object verifyd cannot find: the usual cause in a container is another IPC namespace, and
// the error says so.
TEST(ShmMapping, AMissingObjectAsksAboutTheIpcNamespace) {
  const std::string key = "/vdtest-" + std::to_string(getpid()) + "-missing";
  shm_unlink(key.c_str());
  absl::StatusOr<std::unique_ptr<MappedRegion>> m = MapShm(key, 0, 4096, ::getuid());
  ASSERT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  const std::string msg(m.status().message());
  EXPECT_NE(msg.find("key: no shared-memory object '" + key + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not in the same IPC namespace as verifyd?"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hostIPC"), std::string::npos) << msg;
}

// A verifyd of another user than the object's owner cannot open a 0600 object: the error says
// how a client lets it in (the data socket's group, mode 0660). verifyd is played by a child
// process running as nobody. Needs root.
TEST(ShmMapping, AnObjectVerifydMayNotOpenNamesTheGroupToJoin) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to open the object as another user";
  ShmObject shm("private", 1 << 20);  // root's, 0600
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipefd[0]);
    std::string msg = "setresuid failed";
    if (::setresgid(65534, 65534, 65534) == 0 && ::setresuid(65534, 65534, 65534) == 0) {
      absl::StatusOr<std::unique_ptr<MappedRegion>> m =
          MapShm(shm.key(), 0, shm.size(), std::nullopt);
      msg = m.ok() ? "mapped" : std::string(m.status().ToString());
    }
    (void)!::write(pipefd[1], msg.data(), msg.size());
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string msg;
  char buf[1024];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) msg.append(buf, n);
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_NE(msg.find("PERMISSION_DENIED: key: cannot open shared-memory object '" + shm.key() +
                     "' read-write: Permission denied (verifyd runs as uid 65534; the object "
                     "is uid 0's, group 0, mode 0600: a client of another user joins the data "
                     "socket's group and gives the object to it, read-write, mode 0660"),
            std::string::npos)
      << msg;
}

// The same end to end: a client running as another user (nobody) connects to the data socket,
// and the uid the kernel reports for its connection decides. Its registration of an object of
// root's is refused naming the key; one of its own is mapped. Needs root to start the client as
// nobody (setpriv); the client is RegionChild.RegistersAsTheUserItRunsAs in this binary.
TEST_F(RegionTest, AnotherUsersObjectIsRefusedNamingTheKey) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user";
  Start();
  const std::string sock = dir_ + "/data.sock";
  ASSERT_EQ(::chmod(sock.c_str(), 0777), 0) << std::strerror(errno);  // nobody may connect
  ShmObject root_owned("rootobj", 1 << 20);
  const std::string as_nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  if (std::system((as_nobody + "test -x '" + exe + "'").c_str()) != 0) {
    GTEST_SKIP() << exe << " cannot be run by nobody (a directory on its path is not searchable)";
  }
  const std::string cmd = "VERIFYD_CHILD_TARGET=unix:" + sock +
                          " VERIFYD_CHILD_KEY=" + root_owned.key() + " " + as_nobody + "'" + exe +
                          "' --gtest_filter=RegionChild.RegistersAsTheUserItRunsAs 2>&1";
  FILE* child = ::popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, child)) > 0;) out.append(buf, n);
  const int status = ::pclose(child);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
  EXPECT_EQ(List().regions_size(), 0) << List().DebugString();
}

TEST(RegionChild, RegistersAsTheUserItRunsAs) {
  const char* target = std::getenv("VERIFYD_CHILD_TARGET");
  const char* foreign = std::getenv("VERIFYD_CHILD_KEY");
  if (target == nullptr || foreign == nullptr) {
    GTEST_SKIP() << "the client of RegionTest.AnotherUsersObjectIsRefusedNamingTheKey";
  }
  auto stub = v1::VerifyService::NewStub(Channel(target));
  auto reg = [&](const std::string& name, const std::string& key, uint64_t bytes) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name);
    req.set_key(key);
    req.set_byte_size(bytes);
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return stub->RegisterShmRegion(&ctx, req, &resp);
  };
  grpc::Status st = reg("stolen", foreign, 1 << 20);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("key:", 0), 0u) << st.error_message();
  EXPECT_NE(st.error_message().find("belongs to uid 0, not to the caller (uid " +
                                    std::to_string(::getuid()) + ")"),
            std::string::npos)
      << st.error_message();
  ShmObject own("child", 1 << 20);
  st = reg("own", own.key(), own.size());
  EXPECT_TRUE(st.ok()) << st.error_message();
  v1::UnregisterRegionRequest un;
  un.set_name("own");
  v1::UnregisterRegionResponse unresp;
  grpc::ClientContext ctx;
  EXPECT_TRUE(stub->UnregisterRegion(&ctx, un, &unresp).ok());
}

// An unregister waits for the calls that use the region: the call in flight completes with the
// region's data, and the unregister returns after it. Later calls get NOT_FOUND.
TEST_F(RegionTest, UnregisterWaitsForTheCallInFlight) {
  Start();
  RandomBundleSpec spec = RegionBundleSpec(41, 16, 16, 6000);  // long enough on the CPU to overlap
  spec.heads = 16;
  RandomBundle b(spec);
  const ShmLayout l = ShmLayout::Of(b.view());
  ShmObject shm("inflight", l.end);
  v1::VerifyRequest req;
  EncodeRequest(b.view(), &req);
  PutInShm(b.view(), l, shm.data(), "pool", &req);
  ASSERT_TRUE(RegisterShm("pool", shm).ok());
  ASSERT_TRUE(SetMode(v1::MODE_REFERENCE, true).ok());

  // On a GPU the call can be over in a few milliseconds, before a poll sees it hold the region:
  // such a call is let finish and another started, until one is caught in flight.
  std::atomic<int64_t> call_done_ns{0};
  std::future<grpc::Status> call;
  bool caught = false;
  for (int attempt = 0; attempt < 50 && !caught; ++attempt) {
    call_done_ns = 0;
    call = std::async(std::launch::async, [&] {
      v1::VerifyResponse resp;
      grpc::Status st = VerifyUnix(req, &resp);
      call_done_ns = Clock::now().time_since_epoch().count();
      return st;
    });
    for (int i = 0; i < 20000 && call_done_ns.load() == 0; ++i) {
      if (List().regions(0).in_use() == 1) {
        caught = true;
        break;
      }
    }
    if (!caught) {
      ASSERT_TRUE(call.get().ok());
    }
  }
  ASSERT_TRUE(caught) << "no call was seen holding the region in 50 tries";
  ASSERT_TRUE(Unregister("pool").ok());
  const int64_t unregistered_ns = Clock::now().time_since_epoch().count();
  const grpc::Status st = call.get();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(call_done_ns.load(), 0);
  EXPECT_LE(call_done_ns.load() - 50'000'000, unregistered_ns);  // within scheduling noise
  v1::VerifyResponse resp;
  EXPECT_EQ(VerifyUnix(req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Names member `index` of region set `set` instead of a region.
void SetMember(v1::Tensor* t, const std::string& set, uint32_t index) {
  t->mutable_shm()->clear_region();
  t->mutable_shm()->set_set(set);
  t->mutable_shm()->set_index(index);
}

// 61 shm pools (a layer each, as SGLang's MLA pool allocates them) registered as one set; calls
// naming layers by index give the inline transport's bytes, also when a call's tensors come from
// several members. Listing, status and metrics show the set once.
TEST_F(RegionTest, RegionSetOf61LayersMatchesInline) {
  Start(/*allow_tcp=*/false, /*max_regions=*/-1);
  constexpr int kLayers = 61;
  const std::vector<int> used = {0, 17, 42, 60};
  std::vector<std::unique_ptr<RandomBundle>> bundles(kLayers);
  std::vector<std::unique_ptr<ShmObject>> layers;
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> members;
  for (int i = 0; i < kLayers; ++i) {
    size_t bytes = 4096;  // the layers no call here names stay small
    if (absl::c_linear_search(used, i)) {
      bundles[i] = std::make_unique<RandomBundle>(RegionBundleSpec(500 + i, 16, 3, 40 + i));
      bytes = ShmLayout::Of(bundles[i]->view()).end;
    }
    layers.push_back(std::make_unique<ShmObject>("layer" + std::to_string(i), bytes));
    members.emplace_back(layers.back()->key(), 0, bytes);
  }
  v1::RegisterRegionSetResponse reg;
  grpc::Status st = RegisterSet("layers", members, "rank0", nullptr, &reg);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reg.set().members(), 61u);
  EXPECT_EQ(reg.set().owner(),
            "uid " + std::to_string(::getuid()) + " pid " + std::to_string(::getpid()));

  for (int i : used) {
    const BundleView v = bundles[i]->view();
    v1::VerifyRequest inline_req;
    EncodeRequest(v, &inline_req);
    inline_req.set_want_lse(true);
    v1::VerifyResponse want;
    ASSERT_TRUE(VerifyUnix(inline_req, &want).ok());
    const ShmLayout l = ShmLayout::Of(v);
    v1::VerifyRequest req = inline_req;
    PutInShm(v, l, layers[i]->data(), "", &req);
    for (v1::Tensor* t : {req.mutable_q(), req.mutable_kv_pool(), req.mutable_kv_indptr(),
                          req.mutable_kv_indices(), req.mutable_kv_lens(), req.mutable_tree_mask(),
                          req.mutable_o_out(), req.mutable_lse_out()}) {
      SetMember(t, "layers", static_cast<uint32_t>(i));
    }
    std::memset(layers[i]->data() + l.o, 0xAB, l.end - l.o);
    v1::VerifyResponse got;
    st = VerifyUnix(req, &got);
    ASSERT_TRUE(st.ok()) << "layer " << i << ": " << st.error_message();
    EXPECT_FALSE(got.has_o());
    EXPECT_EQ(std::memcmp(layers[i]->data() + l.o, want.o().raw_contents().data(),
                          want.o().raw_contents().size()),
              0)
        << "o differs, layer " << i;
    EXPECT_EQ(std::memcmp(layers[i]->data() + l.lse, want.lse().raw_contents().data(),
                          want.lse().raw_contents().size()),
              0)
        << "lse differs, layer " << i;
    // The same against the oracle's reference path computed here.
    EXPECT_EQ(want.o().raw_contents(), LocalOutput(inline_req, Path::kReference)) << i;
  }
  // One call across members: q from layer 17's pool, the pool and indices from layer 42's, the
  // output back in the response (a call names any member of any set it may).
  {
    const BundleView v = bundles[42]->view();
    v1::VerifyRequest inline_req;
    EncodeRequest(v, &inline_req);
    const ShmLayout l = ShmLayout::Of(v);
    const ShmLayout l17 = ShmLayout::Of(bundles[17]->view());
    ASSERT_LE(v.q_elems() * 2, l17.kv_pool - l17.q);
    std::memcpy(layers[17]->data() + l17.q, v.q, v.q_elems() * 2);
    v1::VerifyRequest req = inline_req;
    SetShm(req.mutable_q(), "", l17.q, v.q_elems() * 2);
    SetMember(req.mutable_q(), "layers", 17);
    SetShm(req.mutable_kv_pool(), "", l.kv_pool, v.kv_elems() * 2);
    SetMember(req.mutable_kv_pool(), "layers", 42);
    SetShm(req.mutable_kv_indices(), "", l.kv_indices, v.shape.num_indices * 4);
    SetMember(req.mutable_kv_indices(), "layers", 42);
    v1::VerifyResponse want, got;
    ASSERT_TRUE(VerifyUnix(inline_req, &want).ok());
    st = VerifyUnix(req, &got);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(got.o().raw_contents(), want.o().raw_contents());
  }

  const v1::ListRegionsResponse list = List();
  EXPECT_EQ(list.regions_size(), 0) << "members are not listed one by one";
  ASSERT_EQ(list.sets_size(), 1);
  EXPECT_EQ(list.sets(0).name(), "layers");
  EXPECT_EQ(list.sets(0).members(), 61u);
  EXPECT_EQ(list.sets(0).client(), "rank0");
  EXPECT_EQ(list.sets(0).calls(), 4 + 2);  // a call pins each member it names once
  EXPECT_EQ(list.sets(0).in_use(), 0);
  EXPECT_EQ(list.region_count(), 61);
  uint64_t total = 0;
  for (const auto& m : members) total += std::get<2>(m);
  EXPECT_EQ(list.sets(0).byte_size(), total);
  EXPECT_EQ(list.total_bytes(), total);
  const v1::GetStatusResponse status = Status();
  EXPECT_EQ(status.regions_size(), 0);
  ASSERT_EQ(status.region_sets_size(), 1);
  EXPECT_EQ(status.region_count(), 61);
  EXPECT_EQ(status.max_regions(), RegionLimits{}.max_regions);
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_regions 61\n"), std::string::npos);

  // Unregistering the set releases every member.
  v1::UnregisterRegionResponse out;
  ASSERT_TRUE(Unregister("layers", "", &out).ok());
  ASSERT_EQ(out.unregistered_size(), 1);
  EXPECT_EQ(out.unregistered(0), "layers");
  EXPECT_EQ(List().region_count(), 0);
  EXPECT_EQ(List().sets_size(), 0);
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_regions 0\n"), std::string::npos);
}

// Every bad reference to a set and every bad member is refused naming the field (and the member),
// the set is registered whole or not at all, and the daemon keeps serving.
TEST_F(RegionTest, RegionSetRefusalsNameTheFieldAndTheMember) {
  Start();
  RandomBundle b(RegionBundleSpec(601, 16, 3, 40));
  const BundleView v = b.view();
  const ShmLayout l = ShmLayout::Of(v);
  ShmObject big("setbig", l.end);
  ShmObject tiny("settiny", 4096);
  ASSERT_TRUE(RegisterSet("s", {{big.key(), 0, l.end}, {tiny.key(), 0, 4096}}).ok());
  v1::VerifyRequest inline_req;
  EncodeRequest(v, &inline_req);
  v1::VerifyRequest good = inline_req;
  PutInShm(v, l, big.data(), "", &good);
  for (v1::Tensor* t : {good.mutable_q(), good.mutable_kv_pool(), good.mutable_kv_indptr(),
                        good.mutable_kv_indices(), good.mutable_kv_lens(), good.mutable_tree_mask(),
                        good.mutable_o_out()}) {
    SetMember(t, "s", 0);
  }
  v1::VerifyResponse resp;
  ASSERT_TRUE(VerifyUnix(good, &resp).ok());

  struct Case {
    const char* name;
    std::function<void(v1::VerifyRequest*)> edit;
    grpc::StatusCode code;
    std::string message;  // the error starts with it
  };
  const std::vector<Case> cases = {
      {"index out of range", [](v1::VerifyRequest* r) { SetMember(r->mutable_kv_pool(), "s", 2); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "kv_pool: index 2 is out of range for region set 's' (2 members, 0 to 1)"},
      {"member too small", [](v1::VerifyRequest* r) { SetMember(r->mutable_kv_pool(), "s", 1); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "kv_pool: offset " + std::to_string(l.kv_pool) + " + byte_size " +
           std::to_string(v.kv_elems() * 2) + " is past the end of member 1 of region set 's' " +
           "(4096 bytes)"},
      {"unknown set", [](v1::VerifyRequest* r) { SetMember(r->mutable_q(), "nope", 0); },
       grpc::StatusCode::NOT_FOUND, "q: no shm region set 'nope' is registered"},
      {"region and set",
       [](v1::VerifyRequest* r) { r->mutable_q()->mutable_shm()->set_region("s"); },
       grpc::StatusCode::INVALID_ARGUMENT, "q: names both region 's' and region set 's'"},
      {"a set is no region",
       [](v1::VerifyRequest* r) {
         r->mutable_q()->mutable_shm()->clear_set();
         r->mutable_q()->mutable_shm()->set_region("s");
       },
       grpc::StatusCode::NOT_FOUND, "q: no shm region 's' is registered"},
  };
  for (const Case& c : cases) {
    v1::VerifyRequest req = good;
    c.edit(&req);
    grpc::Status st = VerifyUnix(req, &resp);
    EXPECT_EQ(st.error_code(), c.code) << c.name << ": " << st.error_message();
    EXPECT_EQ(st.error_message().rfind(c.message, 0), 0u) << c.name << ": " << st.error_message();
    ASSERT_TRUE(VerifyUnix(good, &resp).ok()) << "still serving after: " << c.name;
  }

  // Registrations: each member is checked as a region is, naming it; nothing is registered.
  grpc::Status st = RegisterSet("t", {{big.key(), 0, 4096}, {"/vdtest-no-such-object", 0, 64}});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("members[1].key:", 0), 0u) << st.error_message();
  st = RegisterSet("t", {{big.key(), 0, 4096}, {big.key(), 8, 64}});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("members[1].offset: 8 is not a multiple of 16", 0), 0u)
      << st.error_message();
  st = RegisterSet("t", {{tiny.key(), 0, 4096}, {tiny.key(), 0, 4097}});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("members[1].byte_size:", 0), 0u) << st.error_message();
  st = RegisterSet("t", {});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message().rfind("members:", 0), 0u) << st.error_message();
  st = RegisterSet("s", {{tiny.key(), 0, 64}});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
  st = RegisterShm("s", tiny);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << "one namespace";
  // Over TCP, as every region RPC.
  st = RegisterSet("t", {{tiny.key(), 0, 64}}, "", verify_.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(List().region_count(), 2);
  EXPECT_EQ(List().sets_size(), 1);
  ASSERT_TRUE(VerifyUnix(good, &resp).ok());
}

// --max_regions_per_client: a client (the process the kernel names on the socket) gets at most
// that many regions, set members included; another process can still register. The refusal
// names the flag and the count; the daemon keeps serving.
TEST_F(RegionTest, PerClientLimitRefusesTheNextRegionAndLeavesOthersTheirs) {
  Start(/*allow_tcp=*/false, /*max_regions=*/-1, /*per_client=*/4);
  ShmObject shm("perclient", 64 * 4096);
  ASSERT_TRUE(
      RegisterSet("mine", {{shm.key(), 0, 4096}, {shm.key(), 4096, 4096}, {shm.key(), 8192, 4096}})
          .ok());
  ASSERT_TRUE(RegisterShm("fourth", shm, 12288, 4096).ok());
  grpc::Status st = RegisterShm("fifth", shm, 16384, 4096, "another name");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  const std::string me = "uid " + std::to_string(::getuid()) + " pid " + std::to_string(::getpid());
  EXPECT_EQ(st.error_message(), "name: client " + me +
                                    " has 4 regions registered (set members included), the most "
                                    "--max_regions_per_client (4) allows");
  st = RegisterSet("more", {{shm.key(), 16384, 4096}});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();

  // Another process: its own four.
  auto other = PeerProcess::Connect(daemon_->listen_addresses()[1]);
  ASSERT_NE(other, nullptr);
  v1::RegisterRegionSetResponse reg;
  st = RegisterSet("theirs", {{shm.key(), 16384, 4096}, {shm.key(), 20480, 4096}}, "",
                   other->stub(), &reg);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_NE(reg.set().owner(), me);
  EXPECT_EQ(reg.set().owner().rfind("uid " + std::to_string(::getuid()) + " pid ", 0), 0u);
  st = RegisterSet("theirs2",
                   {{shm.key(), 24576, 4096}, {shm.key(), 28672, 4096}, {shm.key(), 32768, 4096}},
                   "", other->stub());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find(" has 2 regions registered (set members included) and this "
                                    "set adds 3, the most --max_regions_per_client (4) allows"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(List().region_count(), 6);

  // Unregistering a set frees its members' slots for its client.
  ASSERT_TRUE(Unregister("mine").ok());
  ASSERT_TRUE(RegisterShm("fifth", shm, 16384, 4096).ok());
  v1::VerifyResponse resp;
  EXPECT_TRUE(VerifyUnix(SmallRequest(7), &resp).ok()) << "still serving";
}

// The defaults admit eight ranks of a 61-layer model, each with its own process: four register
// their pools as one set each, four as 61 regions each (488 in all). A daemon-wide limit refuses
// naming --max_regions and the count; unregistering a set frees its slots.
TEST_F(RegionTest, DefaultsAdmitEightRanksOf61Layers) {
  Start(/*allow_tcp=*/false, /*max_regions=*/-1);
  EXPECT_GE(RegionLimits{}.max_regions, 8 * 61);
  EXPECT_GE(RegionLimits{}.max_regions_per_client, 61);
  ShmObject shm("ranks", 61 * 4096);
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> pools;
  for (int i = 0; i < 61; ++i) pools.emplace_back(shm.key(), i * 4096, 4096);
  std::vector<std::unique_ptr<PeerProcess>> ranks;  // each rank's process lives on
  for (int rank = 0; rank < 8; ++rank) {
    ranks.push_back(PeerProcess::Connect(daemon_->listen_addresses()[1]));
    ASSERT_NE(ranks.back(), nullptr);
    v1::VerifyService::Stub* stub = ranks.back()->stub();
    const std::string client = "rank" + std::to_string(rank);
    if (rank % 2 == 0) {
      grpc::Status st = RegisterSet(client, pools, client, stub);
      ASSERT_TRUE(st.ok()) << client << ": " << st.error_message();
    } else {
      for (int i = 0; i < 61; ++i) {
        grpc::Status st =
            RegisterShm(client + "/layer" + std::to_string(i), shm, i * 4096, 4096, client, stub);
        ASSERT_TRUE(st.ok()) << client << " layer " << i << ": " << st.error_message();
      }
    }
  }
  const v1::ListRegionsResponse list = List();
  EXPECT_EQ(list.region_count(), 488);
  EXPECT_EQ(list.sets_size(), 4);
  EXPECT_EQ(list.regions_size(), 4 * 61);
  EXPECT_NE(Scrape(daemon_->metrics_port()).find("verifyd_regions 488\n"), std::string::npos);
  v1::UnregisterRegionResponse out;
  ASSERT_TRUE(Unregister("", "rank1", &out).ok());
  EXPECT_EQ(out.unregistered_size(), 61);
  ASSERT_TRUE(Unregister("", "rank0", &out).ok());
  EXPECT_EQ(out.unregistered_size(), 1);
  EXPECT_EQ(List().region_count(), 488 - 122);
}

TEST_F(RegionTest, DaemonLimitCountsSetMembersAndUnregisteringFreesThem) {
  Start(/*allow_tcp=*/false, /*max_regions=*/10);
  ShmObject shm("daemonwide", 16 * 4096);
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> ten;
  for (int i = 0; i < 10; ++i) ten.emplace_back(shm.key(), i * 4096, 4096);
  ASSERT_TRUE(RegisterSet("ten", ten).ok());
  grpc::Status st = RegisterShm("eleventh", shm, 10 * 4096, 4096);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "name: 10 regions are registered (set members included), the most --max_regions "
            "allows");
  auto other = PeerProcess::Connect(daemon_->listen_addresses()[1]);
  ASSERT_NE(other, nullptr);
  st = RegisterSet("two", {{shm.key(), 0, 4096}, {shm.key(), 4096, 4096}}, "", other->stub());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "name: 10 regions are registered (set members included) and this set adds 2, more "
            "than --max_regions (10) allows");
  v1::VerifyResponse resp;
  EXPECT_TRUE(VerifyUnix(SmallRequest(8), &resp).ok()) << "still serving";
  ASSERT_TRUE(Unregister("ten").ok());
  EXPECT_TRUE(
      RegisterSet("two", {{shm.key(), 0, 4096}, {shm.key(), 4096, 4096}}, "", other->stub()).ok());
  EXPECT_TRUE(RegisterShm("eleventh", shm, 10 * 4096, 4096).ok());
  EXPECT_EQ(List().region_count(), 3);
}

}  // namespace
}  // namespace verifyd::testing
