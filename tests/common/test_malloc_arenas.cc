// BoundMallocArenas: threads that allocate at the same time share the bounded arenas instead of
// getting one each (counted from glibc's malloc_info). Its own process: the bound must be set
// before any thread allocates. KeepFreedMemory: a bundle-sized block freed and allocated again
// is not faulted in again (counted from getrusage's minor faults).

#include <malloc.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "src/common/malloc_arenas.h"
#include "tests/common/sanitizers.h"

namespace verifyd {
namespace {

// Heaps (arenas) glibc reports, from malloc_info's <heap nr="..."> elements.
int Arenas() {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  malloc_info(0, f);
  std::fclose(f);
  const std::string xml(buf, size);
  std::free(buf);
  int n = 0;
  for (size_t pos = 0; (pos = xml.find("<heap nr=", pos)) != std::string::npos; ++pos) ++n;
  return n;
}

// Threads that each allocate and free while all the others do.
void ContendedAllocations(int threads) {
  std::atomic<int> started{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      ++started;
      while (started.load() < threads) std::this_thread::yield();
      for (int i = 0; i < 20000; ++i) {
        void* p = std::malloc(4096 + i);
        std::memset(p, 1, 64);
        std::free(p);
      }
    });
  }
  for (auto& t : ts) t.join();
}

TEST(MallocArenas, BoundHoldsUnderContention) {
#if VERIFYD_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer replaces malloc";
#endif
  if (std::getenv("MALLOC_ARENA_MAX")) GTEST_SKIP() << "MALLOC_ARENA_MAX is set";
  // One arena: without the bound, contending threads reliably get arenas of their own.
  BoundMallocArenas(1);
  ContendedAllocations(16);
  const int arenas = Arenas();
  EXPECT_EQ(arenas, 1) << "glibc made " << arenas << " arenas for 16 contending threads";
}

// Minor page faults while a fresh block of `bytes` is allocated, written and freed.
long FaultsWriting(size_t bytes) {
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  char* p = static_cast<char*>(std::malloc(bytes));
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");  // the writes happen
  getrusage(RUSAGE_SELF, &after);
  std::free(p);
  return after.ru_minflt - before.ru_minflt;
}

constexpr size_t kBundleBytes = size_t{40} << 20;  // over glibc's largest mmap threshold (32 MiB)

bool MallocTunedByEnvironment() {
  return std::getenv("MALLOC_MMAP_MAX_") != nullptr ||
         std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
         std::getenv("GLIBC_TUNABLES") != nullptr;
}

TEST(KeepFreedMemory, ASecondBundleReusesTheFirstOnesPages) {
#if VERIFYD_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer replaces malloc";
#endif
  if (MallocTunedByEnvironment()) GTEST_SKIP() << "malloc is tuned by the environment";
  KeepFreedMemory(int64_t{256} << 20);
  const long first = FaultsWriting(kBundleBytes);
  const long second = FaultsWriting(kBundleBytes);
  EXPECT_GT(first, 0);
  EXPECT_LT(second, first / 4 + 1) << "first bundle " << first << " faults, second " << second;
}

// The reason for it: with glibc's defaults every such block is a fresh mapping.
TEST(KeepFreedMemory, WithGlibcsDefaultsEveryBundleFaultsAgain) {
#if VERIFYD_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer replaces malloc";
#endif
  if (MallocTunedByEnvironment()) GTEST_SKIP() << "malloc is tuned by the environment";
  mallopt(M_MMAP_MAX, 65536);  // glibc's defaults, also after the test above
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  const long first = FaultsWriting(kBundleBytes);
  const long second = FaultsWriting(kBundleBytes);
  EXPECT_GT(second, first / 2) << "first bundle " << first << " faults, second " << second;
}

}  // namespace
}  // namespace verifyd
