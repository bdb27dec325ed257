// verifyd: parse flags, start the daemon, tell systemd, wait for SIGINT/SIGTERM or a fatal
// engine fault.

#include <systemd/sd-daemon.h>

#include <csignal>
#include <cstdio>
#include <thread>

#include "grpc/grpc.h"
#include "spdlog/spdlog.h"
#include "src/common/malloc_arenas.h"
#include "src/daemon/daemon.h"
#include "src/main/daemon_flags.h"

int main(int argc, char** argv) {
  verifyd::BoundMallocArenas();
  if (verifyd::HelpRequested(argc, argv)) {
    std::fputs(verifyd::DaemonHelp().c_str(), stdout);
    return 0;
  }
  absl::StatusOr<verifyd::DaemonOptions> opts = verifyd::ParseDaemonFlags(argc, argv);
  if (!opts.ok()) {
    std::fprintf(stderr, "verifyd: %s\n", std::string(opts.status().message()).c_str());
    return 2;
  }
  verifyd::KeepFreedMemory(opts->keep_freed_bytes);
  // Block the stop signals in every thread; one thread waits for them.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  // gRPC stays initialized until the process exits. The servers' destructors would otherwise
  // make the last grpc_shutdown(), which joins gRPC's executor threads, and after busy traffic
  // one of them can sit in a poll for about 10 s: SIGTERM would take that long.
  grpc_init();  // after the mask: its threads must not take the stop signals

  auto daemon = verifyd::Daemon::Start(*opts);
  if (!daemon.ok()) {
    spdlog::critical("{}", std::string(daemon.status().message()));
    return 1;
  }
  // systemd (Type=notify) learns that verifyd serves; a no-op without NOTIFY_SOCKET.
  sd_notify(0, "READY=1\nSTATUS=serving");
  std::thread([&stop, d = daemon->get()] {
    int sig = 0;
    sigwait(&stop, &sig);
    spdlog::info("signal {}: shutting down", sig);
    d->Shutdown();
  }).detach();
  const int code = (*daemon)->Wait();
  sd_notify(0, "STOPPING=1");
  daemon->reset();
  spdlog::info("verifyd stopped");
  return code;
}
