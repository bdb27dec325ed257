#include "src/region/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace verifyd {
namespace {

// More than --max_regions can be (each shm region maps once).
constexpr int kSlots = 4096;

struct Slot {
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> broken{false};
};

Slot g_slots[kSlots];
std::mutex g_mu;  // slot allocation; the handler reads the atomics only
struct sigaction g_previous;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    const uintptr_t end = s.end.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= end) continue;
    // The raw system call: async-signal-safe, and past any interceptor of mmap.
    const long m = syscall(SYS_mmap, begin, end - begin, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
    if (m == static_cast<long>(begin)) {
      s.broken.store(true, std::memory_order_release);
      return;  // the access runs again, on zero pages
    }
    break;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((g_previous.sa_flags & SA_SIGINFO) == 0 && g_previous.sa_handler != SIG_DFL &&
      g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default: the faulting access runs again and the process ends with SIGBUS.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigaction(SIGBUS, &dfl, nullptr);
}

void InstallHandler() {
  struct sigaction sa {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

absl::StatusOr<int> GuardMapping(void* begin, size_t bytes) {
  static std::once_flag installed;
  std::call_once(installed, InstallHandler);
  std::lock_guard<std::mutex> l(g_mu);
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.begin.load(std::memory_order_relaxed) != 0) continue;
    s.broken.store(false, std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(begin) + bytes, std::memory_order_release);
    s.begin.store(reinterpret_cast<uintptr_t>(begin), std::memory_order_release);
    return i;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("key: ", kSlots, " shared-memory mappings are guarded already"));
}

bool MappingBroken(int slot) { return g_slots[slot].broken.load(std::memory_order_acquire); }

void UnguardMapping(int slot) {
  std::lock_guard<std::mutex> l(g_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
}

}  // namespace verifyd
