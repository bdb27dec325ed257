#include "src/main/daemon_flags.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "spdlog/spdlog.h"
#include "src/common/admin_token.h"
#include "src/common/malloc_arenas.h"
#include "src/common/pem_file.h"
#include "src/common/status_macros.h"
#include "src/fleet/etcd_source.h"

namespace {
// Every flag's default is the default of the option it sets: DaemonOptions is the one source.
const verifyd::DaemonOptions& Defaults() {
  static const verifyd::DaemonOptions d;
  return d;
}
constexpr int64_t Mb(int64_t bytes) { return bytes >> 20; }
}  // namespace

ABSL_FLAG(std::vector<std::string>, listen, Defaults().listen,
          "Data-plane address, HOST:PORT or unix:PATH; repeat or comma-separate for several. "
          "Port 0 picks a free port (logged).");
ABSL_FLAG(std::string, admin_listen, Defaults().admin_listen,
          "Admin address: unix:PATH (mode 0600; the directory is created) or HOST:PORT with "
          "--admin_token_file");
ABSL_FLAG(std::string, data_socket_mode, absl::StrFormat("%04o", Defaults().data_socket.mode),
          "Mode of the data plane's Unix sockets (octal): who may connect and call");
ABSL_FLAG(std::string, data_socket_group, Defaults().data_socket.group,
          "Group of the data plane's Unix sockets (the serving stack's users are in it); empty = "
          "the daemon's own group");
ABSL_FLAG(std::string, admin_token_file, "",
          "File holding the admin bearer token (TCP admin); one line, mode 0600 or stricter");
ABSL_FLAG(bool, insecure_admin_tcp, false,
          "Allow a TCP --admin_listen without TLS (the admin token then travels in clear)");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain: serve the TCP listeners (data plane and admin) over TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: TCP clients must present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, metrics_address, Defaults().metrics_address,
          "Prometheus /metrics address HOST:PORT; empty disables");
ABSL_FLAG(std::string, state_dir, Defaults().state_dir, "Directory for the mode and the audit log");
ABSL_FLAG(std::string, engine, Defaults().engine.kind,
          "auto (CUDA when a GPU is visible), cpu or cuda");
ABSL_FLAG(int, cpu_threads, Defaults().engine.cpu_threads, "CPU engine threads; 0 = all cores");
ABSL_FLAG(std::vector<std::string>, devices, {}, "CUDA devices to serve; empty = all visible");
ABSL_FLAG(int64_t, cuda_pool_mb, Mb(Defaults().engine.cuda_pool_bytes),
          "CUDA memory pool per device, MiB");
ABSL_FLAG(int64_t, cuda_sync_spin_us, Defaults().engine.cuda_sync_spin_us,
          "CUDA engine: how long the wait for a call's served output polls the GPU back to back, "
          "microseconds; it then polls between naps of a 32nd of the time waited (2 to 50 us) "
          "for up to 50 ms, then sleeps in the driver, which wakes tens of microseconds after "
          "the GPU is done; 0 = always sleep in the driver (no core kept busy)");
ABSL_FLAG(int64_t, max_message_mb, Mb(Defaults().max_message_bytes),
          "Largest gRPC message accepted or sent, MiB");
ABSL_FLAG(int, grpc_max_threads, Defaults().grpc_max_threads,
          "Threads serving data-plane calls; a call or stream beyond them gets RESOURCE_EXHAUSTED");
ABSL_FLAG(int, grpc_max_streams, Defaults().streams.max_streams,
          "Data-plane streams open at once; a stream beyond it is refused at once, so that the "
          "rest of --grpc_max_threads serve unary calls. Must be below --grpc_max_threads");
ABSL_FLAG(double, stream_idle_timeout_s, absl::ToDoubleSeconds(Defaults().streams.idle_timeout),
          "A data-plane stream that sends nothing for this long is cancelled, seconds; 0 = never");
ABSL_FLAG(int, grpc_max_streams_per_peer, Defaults().streams.max_streams_per_peer,
          "Of --grpc_max_streams, the streams one peer (a uid on the Unix socket, a host over "
          "TCP) may hold open");
ABSL_FLAG(int, grpc_max_waiting_calls_per_peer, Defaults().streams.max_waiting_calls_per_peer,
          "Unary Verify calls one peer (a uid on the Unix socket, a host over TCP) may have "
          "waiting for their message; each holds a server thread until it arrives");
ABSL_FLAG(int64_t, request_body_timeout_ms,
          absl::ToInt64Milliseconds(Defaults().streams.body_timeout),
          "A unary Verify call whose message has not arrived this long after its headers is "
          "cancelled, whatever the client's deadline, and what it held (a thread, its declared "
          "size's budget) goes back; 0 = never");
ABSL_FLAG(double, max_inflight_peer_share, Defaults().inflight_peer_share,
          "Of --max_inflight_mb, the part one peer (a uid on the Unix socket, a host over TCP) "
          "may hold, in (0, 1]");
ABSL_FLAG(int, grpc_max_concurrent_streams, Defaults().grpc_max_concurrent_streams,
          "Concurrent data-plane streams per connection");
ABSL_FLAG(int64_t, max_inflight_mb, Mb(Defaults().max_inflight_bytes),
          "Memory budget: request bytes all calls in flight may hold together, MiB; 0 = none");
ABSL_FLAG(int64_t, pinned_receive_mb, Mb(Defaults().pinned_receive_bytes),
          "Buffers gRPC request messages are received into, kept between calls, MiB in all: each "
          "message is copied once into one and parsed there, and the CUDA engine pins them, so "
          "inline tensors go to the GPU without another copy (pinning a new buffer takes "
          "milliseconds); 0 = a fresh, unpinned buffer per call");
ABSL_FLAG(int64_t, keep_freed_mb, Mb(Defaults().keep_freed_bytes),
          "Freed memory kept for reuse by later calls instead of being returned to the OS, MiB "
          "(bundles are then not faulted in afresh on every call); 0 = glibc's default");
ABSL_FLAG(int64_t, max_regions, Defaults().regions.max_regions,
          "Shared-memory and CUDA IPC regions all clients may register together, each member of "
          "a region set counting as one (each is a mapping of its own); 0 = none are served");
ABSL_FLAG(int64_t, max_regions_per_client, Defaults().regions.max_regions_per_client,
          "Regions one client may register, set members included; a client is the process the "
          "kernel names on the Unix socket (uid and pid), over TCP the request's client name");
ABSL_FLAG(int64_t, max_regions_per_uid, Defaults().regions.max_regions_per_uid,
          "Regions all processes of one uid may register together, set members included, so "
          "that no one user fills --max_regions");
ABSL_FLAG(std::string, region_sharing, SharingName(Defaults().regions.sharing),
          "Who may use, list and unregister a region or region set, and close a call channel, "
          "besides the process that registered or opened it: uid (the processes of its uid), "
          "process (none), all (every peer that can reach the data socket: one tenant)");
ABSL_FLAG(int64_t, max_channels_per_client, Defaults().channels.max_channels_per_client,
          "Call channels one process (the uid and pid the kernel names on the Unix socket) may "
          "hold open");
ABSL_FLAG(int64_t, max_region_mb, Mb(Defaults().regions.max_total_bytes),
          "Sum of the registered regions' sizes, MiB (regions are the clients' memory, mapped)");
ABSL_FLAG(bool, allow_region_tcp, false,
          "Serve shared-memory and CUDA IPC regions to TCP clients too (default: Unix sockets "
          "only)");
ABSL_FLAG(int64_t, max_channels, Defaults().channels.max_channels,
          "Call channels (a shared-memory request slot with a futex doorbell, one call at a time "
          "each) clients may open; 0 = none");
ABSL_FLAG(int64_t, channel_spin_us, absl::ToInt64Microseconds(Defaults().channels.spin),
          "After a call, the most a channel's thread spins for the next one before it sleeps, "
          "microseconds: twice the last gap between its calls when that gap was within this, "
          "else 50 (a call within the spin pays no wake-up; a spin keeps a core busy; 0 = none)");
ABSL_FLAG(int64_t, doorbell_poll_us, absl::ToInt64Microseconds(Defaults().channels.doorbell_poll),
          "Doorbell channels (calls rung by a GPU stream, which cannot wake a sleeping thread): "
          "past the spin, how long the channel's thread naps between looks at its doorbell, "
          "microseconds; bounds the wake-up of a call after a pause (1 to 10000)");
ABSL_FLAG(int64_t, gate_window, Defaults().controller.gate_window,
          "Clean comparisons in a row needed to flip to canary/custom");
ABSL_FLAG(int64_t, tap_gate_window, Defaults().controller.tap_gate_window,
          "Shadow taps: once calls are tapped, the gate also needs this many tapped comparisons, "
          "with custom's mean rel-L2 against the stack's output within --tap_gate_ratio x the "
          "reference's + --tap_gate_slack");
ABSL_FLAG(double, tap_gate_ratio, Defaults().controller.tap_gate_ratio,
          "Shadow taps: see --tap_gate_window (>= 1)");
ABSL_FLAG(double, tap_gate_slack, Defaults().controller.tap_gate_slack,
          "Shadow taps: see --tap_gate_window (>= 0)");
ABSL_FLAG(int64_t, rollback_breaches, Defaults().controller.rollback_breaches,
          "Breaches within --rollback_window that roll back");
ABSL_FLAG(int64_t, rollback_window, Defaults().controller.rollback_window,
          "Sampled comparisons the rollback counts over");
ABSL_FLAG(double, oracle_sample_rate, Defaults().handler.oracle_sample_rate,
          "Fraction of comparisons that also run the oracle");
ABSL_FLAG(int, shadow_threads, Defaults().shadow_threads,
          "Threads running comparisons off the critical path");
ABSL_FLAG(int, shadow_queue, Defaults().shadow_queue,
          "Comparisons that may wait; beyond it they are skipped");
ABSL_FLAG(double, atol, verifyd::Tolerance{}.atol,
          "Element tolerance: |custom - ref| <= atol + atol_rel*rms(ref row) + rtol*|ref|");
ABSL_FLAG(double, atol_rel, verifyd::Tolerance{}.atol_rel,
          "Element tolerance, part relative to the rms of the reference row (one head's 512)");
ABSL_FLAG(double, rtol, verifyd::Tolerance{}.rtol, "Element tolerance, relative part");
ABSL_FLAG(double, max_rel_l2, verifyd::Tolerance{}.max_rel_l2,
          "Breach when ||custom - ref|| / ||ref|| exceeds it");
ABSL_FLAG(double, max_row_rel_l2, verifyd::Tolerance{}.max_row_rel_l2,
          "Breach when any row's ||custom - ref|| / ||ref|| exceeds it");
ABSL_FLAG(double, max_lse_abs, verifyd::Tolerance{}.max_lse_abs,
          "Breach when any row's lse (natural log, fp32 in both paths) differs by more");
ABSL_FLAG(double, max_abs, verifyd::Tolerance{}.max_abs,
          "Breach when the largest element difference exceeds it");
ABSL_FLAG(int64_t, max_beyond_tol, verifyd::Tolerance{}.max_beyond_tol,
          "Breach when more elements than this fail atol/rtol");
ABSL_FLAG(double, custom_timeout_ms, 0, "A custom path slower than this is a breach; 0 = none");
ABSL_FLAG(int64_t, max_call_work, Defaults().handler.max_call_work,
          "Most work one call may ask for, in query rows x KV tokens (sum of draft * heads * "
          "kv_len over its requests); larger calls get RESOURCE_EXHAUSTED. 0 = no limit");
ABSL_FLAG(int64_t, drift_window, verifyd::DriftOptions{}.window,
          "Oracle drift: oracle samples in the sliding window");
ABSL_FLAG(int64_t, drift_min_samples, verifyd::DriftOptions{}.min_samples,
          "Oracle drift: no verdict on fewer samples");
ABSL_FLAG(double, drift_max_ratio, verifyd::DriftOptions{}.max_ratio,
          "Oracle drift: breach when custom's error vs the oracle is significantly more than this "
          "times the reference's");
ABSL_FLAG(double, drift_min_t, verifyd::DriftOptions{}.min_t,
          "Oracle drift: one-sided t statistic at which the test is in breach");
ABSL_FLAG(bool, probe, true,
          "Run the probe suite at start-up (the gate needs it to pass) and every "
          "--probe_interval while canary/custom is served");
ABSL_FLAG(double, probe_interval, Defaults().probe.interval_seconds,
          "Seconds between probe-suite runs while canary/custom is served; 0 = only at start-up "
          "and on demand");
ABSL_FLAG(int64_t, probe_max_prefix, 0,
          "Longest prefix of the probe suite; 0 = the engine's default (CPU 2048, CUDA 131072)");
ABSL_FLAG(uint64_t, seed, 0x5eed, "Seed of sampling draws for calls without a request id");
ABSL_FLAG(std::string, inject_custom_fault, "",
          "TEST ONLY: make the custom path fail: error | nan | perturb:AMOUNT | bf16_pv (P·V "
          "accumulated in bf16, CPU engine only)");
ABSL_FLAG(std::string, fleet_file, "",
          "Follow a fleet's desired state from this file (a mounted ConfigMap's key; "
          "docs/operations.md, \"Fleets\"); empty = none");
ABSL_FLAG(std::string, fleet_etcd, "",
          "Follow a fleet's desired state from etcd, host:port[,host:port] (its v3 gRPC API, "
          "without TLS: loopback or a cluster-internal network only); the node's status is "
          "reported there too. Not with --fleet_file; empty = none");
ABSL_FLAG(std::string, fleet_etcd_prefix, "/verifyd/fleet",
          "The etcd keys of --fleet_etcd: PREFIX/desired (read), PREFIX/nodes/NODE (written)");
ABSL_FLAG(std::string, node_name, "",
          "This node's name in the fleet's rollout steps and its status key; empty = the host "
          "name");
ABSL_FLAG(std::string, capture_dir, "",
          "Where breaching and requested bundles are written; empty = STATE_DIR/captures, "
          "'off' = no capture");
ABSL_FLAG(int64_t, capture_max_mb, Mb(Defaults().capture.max_bytes),
          "Quota of all capture files together, MiB");
ABSL_FLAG(int64_t, capture_max_files, Defaults().capture.max_files,
          "Quota of capture files (oldest deleted first)");
ABSL_FLAG(int64_t, capture_min_free_mb, Mb(Defaults().capture.min_free_bytes),
          "Free disk a capture always leaves, MiB");
ABSL_FLAG(double, capture_breach_interval_s, Defaults().capture.min_breach_interval_seconds,
          "At most one breach capture per this many s");
ABSL_FLAG(double, shadow_sample_rate, -1,
          "Fraction of shadow calls that also run custom (default 1; persisted once set)");
ABSL_FLAG(double, custom_sample_rate, -1,
          "Fraction of custom calls that also run the reference (default 0.01; persisted)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error");

namespace verifyd {
namespace {

absl::StatusOr<CustomFault> ParseFault(const std::string& s) {
  CustomFault f;
  if (s.empty()) return f;
  if (s == "error") {
    f.kind = CustomFault::Kind::kError;
  } else if (s == "nan") {
    f.kind = CustomFault::Kind::kNan;
  } else if (s == "bf16_pv") {
    f.kind = CustomFault::Kind::kBf16Pv;
  } else if (absl::StartsWith(s, "perturb:") && absl::SimpleAtod(s.substr(8), &f.amount)) {
    f.kind = CustomFault::Kind::kPerturb;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "inject_custom_fault: '", s, "' is not error, nan, bf16_pv or perturb:AMOUNT"));
  }
  return f;
}

absl::StatusOr<TlsOptions> ParseTls() {
  TlsOptions tls;
  const std::string cert = absl::GetFlag(FLAGS_tls_cert_file);
  const std::string key = absl::GetFlag(FLAGS_tls_key_file);
  const std::string ca = absl::GetFlag(FLAGS_tls_client_ca_file);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file, tls_key_file: give both (or neither for plaintext TCP)");
  }
  if (!ca.empty() && cert.empty()) {
    return absl::InvalidArgumentError(
        "tls_client_ca_file: needs --tls_cert_file and --tls_key_file");
  }
  if (cert.empty()) return tls;
  VERIFYD_ASSIGN_OR_RETURN(tls.cert_chain, ReadPemFile("tls_cert_file", cert));
  VERIFYD_ASSIGN_OR_RETURN(tls.private_key, ReadPemFile("tls_key_file", key));
  if (!ca.empty()) {
    VERIFYD_ASSIGN_OR_RETURN(tls.client_ca, ReadPemFile("tls_client_ca_file", ca));
  }
  return tls;
}

// absl keeps only the last --listen; collect every occurrence so the flag can repeat.
std::vector<std::string> AllListen(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--listen=") || absl::ConsumePrefix(&a, "-listen=")) {
      for (auto part : absl::StrSplit(a, ',', absl::SkipEmpty())) out.emplace_back(part);
    } else if ((a == "--listen" || a == "-listen") && i + 1 < argc) {
      for (auto part : absl::StrSplit(argv[++i], ',', absl::SkipEmpty())) out.emplace_back(part);
    }
  }
  return out;
}

constexpr char kUsage[] =
    "verifyd: shadow-verifies a custom MLA tree-verify attention kernel against a reference.\n"
    "  verifyd [--listen=unix:PATH|HOST:PORT ...] [--state_dir=DIR] [--engine=auto|cpu|cuda]";

// The daemon's own flags are the ones defined in this file.
bool IsDaemonFlagFile(absl::string_view file) { return absl::EndsWith(file, "daemon_flags.cc"); }

void ConfigureUsage() {
  static const bool once = [] {
    absl::SetProgramUsageMessage(kUsage);
    absl::FlagsUsageConfig config;
    config.contains_help_flags = IsDaemonFlagFile;
    config.contains_helpshort_flags = IsDaemonFlagFile;
    config.version_string = [] { return DaemonVersion() + "\n"; };
    absl::SetFlagsUsageConfig(config);
    return true;
  }();
  (void)once;
}

// Where the daemon listens and who may call it: data-plane and admin addresses, the admin token,
// TLS, the metrics address, and the state directory.
absl::Status ParseAddresses(int argc, char** argv, DaemonOptions* o) {
  o->listen = AllListen(argc, argv);
  if (o->listen.empty()) o->listen = absl::GetFlag(FLAGS_listen);
  o->admin_listen = absl::GetFlag(FLAGS_admin_listen);
  const std::string mode = absl::GetFlag(FLAGS_data_socket_mode);
  char* end = nullptr;
  const unsigned long m = std::strtoul(mode.c_str(), &end, 8);
  if (mode.empty() || *end != '\0' || m > 0777) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_socket_mode: '", mode, "' is not an octal mode such as 0660"));
  }
  o->data_socket.mode = static_cast<unsigned>(m);
  o->data_socket.group = absl::GetFlag(FLAGS_data_socket_group);
  if (const std::string f = absl::GetFlag(FLAGS_admin_token_file); !f.empty()) {
    VERIFYD_ASSIGN_OR_RETURN(o->admin_token, ReadAdminTokenFile("admin_token_file", f, true));
  }
  o->insecure_admin_tcp = absl::GetFlag(FLAGS_insecure_admin_tcp);
  VERIFYD_ASSIGN_OR_RETURN(o->tls, ParseTls());
  o->metrics_address = absl::GetFlag(FLAGS_metrics_address);
  o->state_dir = absl::GetFlag(FLAGS_state_dir);
  return absl::OkStatus();
}

// The engine: its kind, CPU threads, CUDA devices, memory pool and how its waits poll.
absl::Status ParseEngine(DaemonOptions* o) {
  o->engine.kind = absl::GetFlag(FLAGS_engine);
  o->engine.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  for (const std::string& d : absl::GetFlag(FLAGS_devices)) {
    int id;
    if (!absl::SimpleAtoi(d, &id) || id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("devices: '", d, "' is not a device index"));
    }
    o->engine.devices.push_back(id);
  }
  o->engine.cuda_pool_bytes = absl::GetFlag(FLAGS_cuda_pool_mb) << 20;
  o->engine.cuda_sync_spin_us = absl::GetFlag(FLAGS_cuda_sync_spin_us);
  if (o->engine.cuda_sync_spin_us < 0 || o->engine.cuda_sync_spin_us > 100000) {
    return absl::InvalidArgumentError("cuda_sync_spin_us: must be in [0, 100000]");
  }
  return absl::OkStatus();
}

// gRPC's limits and the memory calls may hold: message size, threads, streams, bytes in flight,
// the receive buffers and the freed memory kept for reuse.
absl::Status ParseGrpcLimits(DaemonOptions* o) {
  o->max_message_bytes = absl::GetFlag(FLAGS_max_message_mb) << 20;
  o->grpc_max_threads = absl::GetFlag(FLAGS_grpc_max_threads);
  o->grpc_max_concurrent_streams = absl::GetFlag(FLAGS_grpc_max_concurrent_streams);
  if (o->grpc_max_threads < 2) return absl::InvalidArgumentError("grpc_max_threads: must be >= 2");
  o->streams.max_streams = absl::GetFlag(FLAGS_grpc_max_streams);
  if (o->streams.max_streams < 0 || o->streams.max_streams >= o->grpc_max_threads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grpc_max_streams: must be in [0, --grpc_max_threads) = [0, ", o->grpc_max_threads, ")"));
  }
  const double idle_s = absl::GetFlag(FLAGS_stream_idle_timeout_s);
  if (!(idle_s >= 0)) return absl::InvalidArgumentError("stream_idle_timeout_s: must be >= 0");
  o->streams.idle_timeout = absl::Seconds(idle_s);
  o->streams.max_streams_per_peer = absl::GetFlag(FLAGS_grpc_max_streams_per_peer);
  if (o->streams.max_streams_per_peer < 1) {
    return absl::InvalidArgumentError("grpc_max_streams_per_peer: must be >= 1");
  }
  o->streams.max_waiting_calls_per_peer = absl::GetFlag(FLAGS_grpc_max_waiting_calls_per_peer);
  if (o->streams.max_waiting_calls_per_peer < 1) {
    return absl::InvalidArgumentError("grpc_max_waiting_calls_per_peer: must be >= 1");
  }
  const int64_t body_ms = absl::GetFlag(FLAGS_request_body_timeout_ms);
  if (body_ms < 0) return absl::InvalidArgumentError("request_body_timeout_ms: must be >= 0");
  o->streams.body_timeout = absl::Milliseconds(body_ms);
  o->inflight_peer_share = absl::GetFlag(FLAGS_max_inflight_peer_share);
  if (!(o->inflight_peer_share > 0 && o->inflight_peer_share <= 1)) {
    return absl::InvalidArgumentError("max_inflight_peer_share: must be in (0, 1]");
  }
  if (o->grpc_max_concurrent_streams < 1) {
    return absl::InvalidArgumentError("grpc_max_concurrent_streams: must be >= 1");
  }
  o->max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_mb) << 20;
  const int64_t receive_mb = absl::GetFlag(FLAGS_pinned_receive_mb);
  if (receive_mb < 0 || receive_mb > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError("pinned_receive_mb: must be in [0, 2^20]");
  }
  o->pinned_receive_bytes = static_cast<uint64_t>(receive_mb) << 20;
  const int64_t keep_mb = absl::GetFlag(FLAGS_keep_freed_mb);
  if (keep_mb < 0 || keep_mb > kMaxKeepFreedMb) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_freed_mb: must be in [0, ", kMaxKeepFreedMb, "]"));
  }
  o->keep_freed_bytes = keep_mb << 20;
  return absl::OkStatus();
}

// The transports besides gRPC messages: shared-memory and CUDA IPC regions, and call channels.
absl::Status ParseRegionsAndChannels(DaemonOptions* o) {
  o->regions.max_regions = absl::GetFlag(FLAGS_max_regions);
  // Each shm region and call channel takes one of the SIGBUS guard's 4096 slots
  // (src/region/sigbus_guard.cc), and channels may take up to 1024 of them.
  if (o->regions.max_regions < 0 || o->regions.max_regions > 3072) {
    return absl::InvalidArgumentError("max_regions: must be in [0, 3072]");
  }
  o->regions.max_regions_per_client = absl::GetFlag(FLAGS_max_regions_per_client);
  if (o->regions.max_regions_per_client < 1 || o->regions.max_regions_per_client > 3072) {
    return absl::InvalidArgumentError("max_regions_per_client: must be in [1, 3072]");
  }
  o->regions.max_regions_per_uid = absl::GetFlag(FLAGS_max_regions_per_uid);
  if (o->regions.max_regions_per_uid < 1 || o->regions.max_regions_per_uid > 3072) {
    return absl::InvalidArgumentError("max_regions_per_uid: must be in [1, 3072]");
  }
  absl::StatusOr<Sharing> sharing = ParseSharing(absl::GetFlag(FLAGS_region_sharing));
  if (!sharing.ok()) return sharing.status();
  o->regions.sharing = o->channels.sharing = *sharing;
  const int64_t region_mb = absl::GetFlag(FLAGS_max_region_mb);
  if (region_mb < 1 || region_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError("max_region_mb: must be in [1, 2^40]");
  }
  o->regions.max_total_bytes = static_cast<uint64_t>(region_mb) << 20;
  o->allow_region_tcp = absl::GetFlag(FLAGS_allow_region_tcp);
  const int64_t max_channels = absl::GetFlag(FLAGS_max_channels);
  if (max_channels < 0 || max_channels > 1024) {
    return absl::InvalidArgumentError("max_channels: must be in [0, 1024]");
  }
  o->channels.max_channels = static_cast<int>(max_channels);
  const int64_t per_client = absl::GetFlag(FLAGS_max_channels_per_client);
  if (per_client < 1 || per_client > 1024) {
    return absl::InvalidArgumentError("max_channels_per_client: must be in [1, 1024]");
  }
  o->channels.max_channels_per_client = static_cast<int>(per_client);
  const int64_t spin_us = absl::GetFlag(FLAGS_channel_spin_us);
  if (spin_us < 0 || spin_us > 1000000) {
    return absl::InvalidArgumentError("channel_spin_us: must be in [0, 1000000]");
  }
  o->channels.spin = absl::Microseconds(spin_us);
  const int64_t poll_us = absl::GetFlag(FLAGS_doorbell_poll_us);
  if (poll_us < 1 || poll_us > 10000) {
    return absl::InvalidArgumentError("doorbell_poll_us: must be in [1, 10000]");
  }
  o->channels.doorbell_poll = absl::Microseconds(poll_us);
  return absl::OkStatus();
}

// The mode controller: the gate, rollback, the oracle drift test and the probe suite.
absl::Status ParseControl(DaemonOptions* o) {
  o->controller.gate_window = absl::GetFlag(FLAGS_gate_window);
  o->controller.tap_gate_window = absl::GetFlag(FLAGS_tap_gate_window);
  o->controller.tap_gate_ratio = absl::GetFlag(FLAGS_tap_gate_ratio);
  o->controller.tap_gate_slack = absl::GetFlag(FLAGS_tap_gate_slack);
  if (o->controller.tap_gate_window < 1 || o->controller.tap_gate_window > 100000) {
    return absl::InvalidArgumentError("tap_gate_window: must be in [1, 100000]");
  }
  if (!(o->controller.tap_gate_ratio >= 1) || !std::isfinite(o->controller.tap_gate_ratio)) {
    return absl::InvalidArgumentError("tap_gate_ratio: must be finite and >= 1");
  }
  if (!(o->controller.tap_gate_slack >= 0) || !std::isfinite(o->controller.tap_gate_slack)) {
    return absl::InvalidArgumentError("tap_gate_slack: must be finite and >= 0");
  }
  o->controller.rollback_breaches = absl::GetFlag(FLAGS_rollback_breaches);
  o->controller.rollback_window = absl::GetFlag(FLAGS_rollback_window);
  o->controller.seed = absl::GetFlag(FLAGS_seed);
  o->controller.drift.window = absl::GetFlag(FLAGS_drift_window);
  o->controller.drift.min_samples = absl::GetFlag(FLAGS_drift_min_samples);
  o->controller.drift.max_ratio = absl::GetFlag(FLAGS_drift_max_ratio);
  o->controller.drift.min_t = absl::GetFlag(FLAGS_drift_min_t);
  if (absl::Status st = ValidateDriftOptions(o->controller.drift); !st.ok()) return st;
  o->probe.at_start = absl::GetFlag(FLAGS_probe);
  o->probe.interval_seconds = absl::GetFlag(FLAGS_probe_interval);
  if (!(o->probe.interval_seconds >= 0)) {
    return absl::InvalidArgumentError("probe_interval: must be >= 0 (0 = never periodically)");
  }
  o->probe.suite.max_prefix = absl::GetFlag(FLAGS_probe_max_prefix);  // 0: the engine's default
  if (o->probe.suite.max_prefix != 0) {
    if (absl::Status st = ValidateProbeSuiteOptions(o->probe.suite); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// The handler: the oracle's sample rate, the tolerances a comparison is judged by, the custom
// path's timeout and the most work one call may ask for.
absl::Status ParseHandler(DaemonOptions* o) {
  o->handler.oracle_sample_rate = absl::GetFlag(FLAGS_oracle_sample_rate);
  o->handler.tolerance.atol = absl::GetFlag(FLAGS_atol);
  o->handler.tolerance.rtol = absl::GetFlag(FLAGS_rtol);
  o->handler.tolerance.max_rel_l2 = absl::GetFlag(FLAGS_max_rel_l2);
  o->handler.tolerance.atol_rel = absl::GetFlag(FLAGS_atol_rel);
  o->handler.tolerance.max_row_rel_l2 = absl::GetFlag(FLAGS_max_row_rel_l2);
  o->handler.tolerance.max_abs = absl::GetFlag(FLAGS_max_abs);
  o->handler.tolerance.max_lse_abs = absl::GetFlag(FLAGS_max_lse_abs);
  o->handler.tolerance.max_beyond_tol = absl::GetFlag(FLAGS_max_beyond_tol);
  o->handler.custom_timeout_seconds = absl::GetFlag(FLAGS_custom_timeout_ms) / 1000.0;
  o->handler.seed = absl::GetFlag(FLAGS_seed) ^ 0x0c1e;
  o->handler.max_call_work = absl::GetFlag(FLAGS_max_call_work);
  if (o->handler.max_call_work < 0) {
    return absl::InvalidArgumentError("max_call_work: must be >= 0 (0 = no limit)");
  }
  if (!(o->handler.tolerance.atol_rel >= 0)) {
    return absl::InvalidArgumentError("atol_rel: must be >= 0");
  }
  if (!(o->handler.tolerance.max_row_rel_l2 >= 0)) {
    return absl::InvalidArgumentError("max_row_rel_l2: must be >= 0");
  }
  if (!(o->handler.tolerance.max_lse_abs >= 0)) {
    return absl::InvalidArgumentError("max_lse_abs: must be >= 0");
  }
  return absl::OkStatus();
}

// Comparisons off the critical path: the threads that run them, the queue they wait in, the
// sample rates that pick them, and the clean ones in a row the gate waits for.
absl::Status ParseShadow(DaemonOptions* o) {
  o->shadow_threads = absl::GetFlag(FLAGS_shadow_threads);
  o->shadow_queue = absl::GetFlag(FLAGS_shadow_queue);
  o->shadow_sample_rate = absl::GetFlag(FLAGS_shadow_sample_rate);
  o->custom_sample_rate = absl::GetFlag(FLAGS_custom_sample_rate);
  if (o->shadow_threads < 1) return absl::InvalidArgumentError("shadow_threads: must be >= 1");
  if (o->shadow_queue < 1) return absl::InvalidArgumentError("shadow_queue: must be >= 1");
  if (o->controller.gate_window < 1) {
    return absl::InvalidArgumentError("gate_window: must be >= 1");
  }
  return absl::OkStatus();
}

// The fleet's desired state this node follows, and its name in the rollout's steps.
absl::Status ParseFleet(DaemonOptions* o) {
  o->fleet_file = absl::GetFlag(FLAGS_fleet_file);
  o->node_name = absl::GetFlag(FLAGS_node_name);
  const std::string etcd = absl::GetFlag(FLAGS_fleet_etcd);
  o->fleet_etcd_prefix = absl::GetFlag(FLAGS_fleet_etcd_prefix);
  if (etcd.empty()) return absl::OkStatus();
  if (!o->fleet_file.empty()) {
    return absl::InvalidArgumentError(
        "--fleet_file and --fleet_etcd are two sources of the fleet's desired state: give one");
  }
  VERIFYD_ASSIGN_OR_RETURN(o->fleet_etcd, fleet::ParseEtcdEndpoints(etcd));
  if (!absl::StartsWith(o->fleet_etcd_prefix, "/")) {
    return absl::InvalidArgumentError("fleet_etcd_prefix: must start with '/'");
  }
  return absl::OkStatus();
}

// Where bundles are captured (under the state directory unless given) and the captures' quotas.
void ParseCapture(DaemonOptions* o) {
  const std::string cap = absl::GetFlag(FLAGS_capture_dir);
  o->capture.dir = cap == "off" ? "" : (cap.empty() ? o->state_dir + "/captures" : cap);
  o->capture.max_bytes = absl::GetFlag(FLAGS_capture_max_mb) << 20;
  o->capture.max_files = absl::GetFlag(FLAGS_capture_max_files);
  o->capture.min_free_bytes = absl::GetFlag(FLAGS_capture_min_free_mb) << 20;
  o->capture.min_breach_interval_seconds = absl::GetFlag(FLAGS_capture_breach_interval_s);
}

}  // namespace

bool HelpRequested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    if (a == "--help" || a == "-help" || a == "-h" || a == "--help=true") return true;
  }
  return false;
}

std::string DaemonHelp() {
  ConfigureUsage();
  std::map<std::string, const absl::CommandLineFlag*> flags;  // sorted by name
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsDaemonFlagFile(flag->Filename())) flags.emplace(std::string(name), flag);
  }
  std::string out = absl::StrCat(kUsage, "\n\nFlags:\n");
  for (const auto& [name, flag] : flags) {
    absl::StrAppend(&out, "  --", name, "=", flag->DefaultValue(), "\n      ", flag->Help(), "\n");
  }
  absl::StrAppend(&out, "  --help\n      Print this and exit\n",
                  "  --version\n      Print the version and commit and exit\n");
  return out;
}

absl::StatusOr<DaemonOptions> ParseDaemonFlags(int argc, char** argv) {
  ConfigureUsage();
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", rest[1], "'"));
  }
  auto level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  spdlog::set_level(level);

  DaemonOptions o;
  VERIFYD_RETURN_IF_ERROR(ParseAddresses(argc, argv, &o));
  VERIFYD_RETURN_IF_ERROR(ParseEngine(&o));
  VERIFYD_RETURN_IF_ERROR(ParseGrpcLimits(&o));
  VERIFYD_RETURN_IF_ERROR(ParseRegionsAndChannels(&o));
  VERIFYD_RETURN_IF_ERROR(ParseControl(&o));
  VERIFYD_RETURN_IF_ERROR(ParseHandler(&o));
  VERIFYD_RETURN_IF_ERROR(ParseShadow(&o));
  ParseCapture(&o);
  VERIFYD_RETURN_IF_ERROR(ParseFleet(&o));
  VERIFYD_ASSIGN_OR_RETURN(o.inject_custom_fault,
                           ParseFault(absl::GetFlag(FLAGS_inject_custom_fault)));
  return o;
}

}  // namespace verifyd
