#include "src/loadgen/send_command.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "fmt/format.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/channel/channel_client.h"
#include "src/cli/cli_common.h"
#include "src/loadgen/pieces_call.h"
#include "src/loadgen/send_regions.h"
#include "src/transport/request_bytes.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

struct Tally {
  std::mutex mu;
  std::vector<double> latency_s;
  std::vector<double> server_s;
  // Server-side stage timings: decode, prepare (host to device), served path, fetch (back).
  std::vector<double> decode_s, prepare_s, served_path_s, served_device_s, fetch_s, parse_s;
  std::map<std::string, int64_t> served;
  std::map<std::string, int64_t> errors;
  std::string first_error;
  int first_code = 0;  // first_error's code and message, for AddressHint
  std::string first_message;
  int64_t checked = 0, unchecked = 0;  // --check: outputs compared with inline / not comparable
  std::atomic<bool> channel_refused{false};  // the daemon refused a worker's call channel

  void Ok(double lat, const v1::VerifyResponse& r) {
    std::lock_guard<std::mutex> l(mu);
    latency_s.push_back(lat);
    server_s.push_back(r.timing().total_seconds());
    decode_s.push_back(r.timing().decode_seconds());
    prepare_s.push_back(r.timing().prepare_seconds());
    served_path_s.push_back(r.timing().served_seconds());
    served_device_s.push_back(r.timing().served_device_seconds());
    fetch_s.push_back(r.timing().fetch_seconds());
    parse_s.push_back(r.timing().parse_seconds());
    served[r.served_path() == v1::PATH_CUSTOM ? "custom" : "reference"]++;
  }
  // `calls` that failed with one code: a broken stream fails the call in flight and every call
  // its worker had left.
  void Err(int code, const std::string& msg, int64_t calls = 1) {
    std::lock_guard<std::mutex> l(mu);
    const std::string name = CodeName(code);
    errors[name] += calls;
    if (first_error.empty()) {
      first_error = name + ": " + msg;
      first_code = code;
      first_message = msg;
    }
  }
};

// The first option that is out of range or contradicts another, as the message to fail with; empty
// when the options make a run. Fills in the parsed shape, traffic model and transport.
std::string CheckOptions(const SendOptions& s, std::vector<int64_t>* dims, Traffic* traffic,
                         SendTransport* transport) {
  for (auto part : absl::StrSplit(s.shape, ',')) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) return "--shape: expected B,T,H,PREFIX";
    dims->push_back(v);
  }
  if (dims->size() != 4) return "--shape: expected B,T,H,PREFIX";
  if (s.count < 1 || s.concurrency < 1) return "--count and --concurrency must be >= 1";
  if (s.tree != "tree" && s.tree != "chain") return "--tree: tree or chain";
  if (!ParseTraffic(s.traffic, traffic)) return "--traffic: random or realistic";
  if (!ParseSendTransport(s.transport, transport)) return "--transport: inline, shm or cuda_ipc";
  if (s.kv_dtype != "bf16" && s.kv_dtype != "e4m3") return "--kv_dtype: bf16 or e4m3";
  if (!(std::isfinite(s.kv_scale) && s.kv_scale > 0)) {
    return absl::StrCat("--kv_scale: ", s.kv_scale, " must be finite and > 0");
  }
  if (s.kv_dtype == "bf16" && s.kv_scale != 1.f) return "--kv_scale: needs --kv_dtype e4m3";
  const bool regions = *transport != SendTransport::kInline;
  if (s.inline_encode != "pieces" && s.inline_encode != "message") {
    return "--inline_encode: pieces or message";
  }
  if (s.channel && s.stream) return "--channel and --stream: choose one";
  if ((s.check || s.scribble || s.resident) && !regions) {
    return "--check, --scribble and --resident need --transport shm or cuda_ipc";
  }
  if (s.scribble && s.resident) {
    return "--scribble and --resident: choose one (scribbling overwrites what stays resident)";
  }
  return "";
}

// The few distinct bundles the workers reuse round-robin, each encoded once.
struct Workload {
  int distinct = 0;
  // Inline unary calls send q and the pool from the bundle's own memory (SerializeRequestAround),
  // as a serving stack's client would: not copied into the message, nor into a serialized buffer.
  bool around = false;
  std::vector<v1::VerifyRequest> requests;
  std::vector<InPlaceTensors> bulks;  // with `around`: each request's q and pool
  std::vector<std::unique_ptr<RandomBundle>> bundles;
};

void MakeWorkload(const SendOptions& s, const std::vector<int64_t>& dims, Traffic traffic,
                  bool regions, Workload* w) {
  w->distinct = static_cast<int>(std::clamp<int64_t>(s.distinct, 1, s.count));
  w->around = !regions && !s.channel && !s.stream && s.inline_encode == "pieces";
  w->requests.resize(w->distinct);
  w->bulks.resize(w->distinct);
  for (int i = 0; i < w->distinct; ++i) {
    RandomBundleSpec spec;
    spec.batch = static_cast<int>(dims[0]);
    spec.draft = static_cast<int>(dims[1]);
    spec.heads = static_cast<int>(dims[2]);
    spec.prefix = dims[3];
    spec.page_size = s.page_size;
    spec.tree = s.tree == "chain" ? TreeKind::kChain : TreeKind::kRandomTree;
    spec.traffic = traffic;
    spec.seed = s.seed + i;
    if (s.kv_dtype == "e4m3") {
      spec.kv_dtype = kernels::KvDtype::kE4m3;
      spec.kv_scale = s.kv_scale;
    }
    const RandomBundle& b = *w->bundles.emplace_back(std::make_unique<RandomBundle>(spec));
    EncodeRequest(b.view(), &w->requests[i], w->around ? &w->bulks[i] : nullptr);
    w->requests[i].set_want_lse(s.want_lse);
    w->requests[i].set_compare_sync(s.compare_sync);
    w->requests[i].set_device(s.device);
  }
}

// The client's own encoding of one call (what gRPC does to the message before sending it, or the
// pieces it sends), and the bytes a call carries (every bundle has the same shape).
struct ClientEncode {
  std::vector<double> seconds;
  int64_t bundle_bytes = 0;
};

ClientEncode TimeClientEncode(const Workload& w) {
  ClientEncode e;
  for (int i = 0; i < 5; ++i) {
    const auto t = Clock::now();
    const uint64_t bytes = w.around ? SerializeRequestAround(w.requests[0], w.bulks[0]).size()
                                    : w.requests[0].SerializeAsString().size();
    e.bundle_bytes = static_cast<int64_t>(bytes);
    e.seconds.push_back(std::chrono::duration<double>(Clock::now() - t).count());
  }
  return e;
}

// A channel's areas hold the largest request and its response (o and lse inline unless the call
// names o_out).
uint64_t ChannelBytes(const Workload& w) {
  uint64_t area = 0;
  for (size_t i = 0; i < w.requests.size(); ++i) {
    const BundleView& v = w.bundles[i]->view();
    const uint64_t rows = static_cast<uint64_t>(v.rows()) * v.shape.heads;
    area = std::max<uint64_t>(
        area, std::max<uint64_t>(w.requests[i].ByteSizeLong(), rows * (512 * 2 + 4)));
  }
  return channel::kHeaderBytes + 2 * (area + (64 << 10));
}

// One worker's way to the daemon besides the shared stub: a call channel, a caller that sends
// pieces, or a stream, as the options ask.
struct WorkerTransport {
  std::unique_ptr<channel::ChannelClient> chan;
  std::optional<PiecesCaller> pieces_caller;
  std::unique_ptr<grpc::ClientContext> sctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream;
};

// The concurrent workers: each takes the next call number until `count` are taken.
class Workers {
 public:
  Workers(const GlobalOptions& g, const SendOptions& s, const Workload& w,
          std::shared_ptr<grpc::Channel> channel, v1::VerifyService::Stub& stub, SendRegion* region,
          const std::vector<v1::VerifyResponse>& inline_out, Tally* tally)
      : g_(g),
        s_(s),
        w_(w),
        channel_(std::move(channel)),
        stub_(stub),
        region_(region),
        inline_out_(inline_out),
        tally_(*tally),
        channel_bytes_(s.channel ? ChannelBytes(w) : 0),
        opened_(static_cast<std::ptrdiff_t>(s.concurrency)) {}

  void Run() {
    std::vector<std::thread> threads;
    for (int i = 0; i < s_.concurrency; ++i) threads.emplace_back([this] { Work(); });
    for (auto& t : threads) t.join();
  }

 private:
  enum class CallResult { kOk, kFailed, kTransportBroken };

  void Work();
  bool OpenTransport(int slot, WorkerTransport* t);
  CallResult Call(WorkerTransport& t, const v1::VerifyRequest& req, int bundle,
                  v1::VerifyResponse* resp);
  void CheckOutput(int slot, int bundle, int64_t n, const v1::VerifyResponse& resp);

  // A worker whose transport broke fails `held` calls (0, or the one in hand) and every call no
  // other worker has taken yet.
  void GiveUp(int code, const std::string& why, int64_t held) {
    tally_.Err(code, why, held + std::max<int64_t>(0, s_.count - next_.exchange(s_.count)));
  }

  const GlobalOptions& g_;
  const SendOptions& s_;
  const Workload& w_;
  const std::shared_ptr<grpc::Channel> channel_;
  v1::VerifyService::Stub& stub_;
  SendRegion* const region_;                           // region transports: one slot per worker
  const std::vector<v1::VerifyResponse>& inline_out_;  // --check: each bundle's inline output
  Tally& tally_;
  const uint64_t channel_bytes_;
  std::atomic<int64_t> next_{0};
  std::atomic<int> next_slot_{0};
  std::barrier<> opened_;
};

void Workers::Work() {
  const int slot = next_slot_.fetch_add(1);
  WorkerTransport t;
  if (!OpenTransport(slot, &t)) return;
  // Calls start once every worker has its transport: opening one is not part of the calls.
  opened_.arrive_and_wait();
  std::optional<v1::VerifyRequest> resident;  // --resident: the call naming the staged slot
  int bundle = 0;                             // the bundle in the slot
  for (int64_t n; (n = next_.fetch_add(1)) < s_.count;) {
    if (!resident) bundle = static_cast<int>(n % w_.distinct);
    v1::VerifyRequest req = resident ? *resident : w_.requests[bundle];
    if (region_ && !resident) {
      if (absl::Status st = region_->Stage(slot, w_.bundles[bundle]->view(), &req); !st.ok()) {
        tally_.Err(static_cast<int>(st.code()), std::string(st.message()));
        continue;
      }
      if (s_.resident) resident = req;
    }
    if (!s_.request_id_prefix.empty())
      req.set_request_id(fmt::format("{}-{}", s_.request_id_prefix, n));
    v1::VerifyResponse resp;
    const auto start = Clock::now();
    const CallResult result = Call(t, req, bundle, &resp);
    if (result == CallResult::kTransportBroken) return;
    if (result == CallResult::kFailed) continue;
    tally_.Ok(std::chrono::duration<double>(Clock::now() - start).count(), resp);
    if (region_ && s_.check) CheckOutput(slot, bundle, n, resp);
    if (region_ && s_.scribble) {
      if (absl::Status st = region_->Scribble(slot); !st.ok()) {
        tally_.Err(static_cast<int>(st.code()), std::string(st.message()));
      }
    }
  }
  if (t.stream) {
    t.stream->WritesDone();
    if (const grpc::Status st = t.stream->Finish(); !st.ok()) {
      tally_.Err(st.error_code(), "stream: " + st.error_message(), 0);
    }
  }
}

// False when the worker's call channel could not be opened: it has then given up its share of the
// calls and left the barrier.
bool Workers::OpenTransport(int slot, WorkerTransport* t) {
  if (s_.channel) {
    channel::ChannelClientOptions co;
    co.name = fmt::format("verifyctl-{}-{}", getpid(), slot);
    co.byte_size = channel_bytes_;
    co.client = fmt::format("verifyctl-{}", getpid());
    auto c = channel::ChannelClient::Open(
        stub_, [&g = g_] { return MakeContext(g, false); }, co);
    if (!c.ok()) {
      tally_.channel_refused = true;
      GiveUp(static_cast<int>(c.status().code()),
             // The daemon's refusal names OpenChannel already.
             absl::StartsWith(c.status().message(), "OpenChannel")
                 ? std::string(c.status().message())
                 : "OpenChannel: " + std::string(c.status().message()),
             0);
      opened_.arrive_and_drop();
      return false;
    }
    t->chan = std::move(*c);
  }
  if (w_.around) t->pieces_caller.emplace(channel_);
  if (s_.stream) {
    t->sctx = MakeContext(g_, false);
    t->sctx->set_deadline(std::chrono::system_clock::time_point::max());
    t->stream = stub_.VerifyStream(t->sctx.get());
  }
  return true;
}

// One call over the worker's transport. A call that fails is tallied; a broken stream or channel
// also gives up every call not yet taken.
Workers::CallResult Workers::Call(WorkerTransport& t, const v1::VerifyRequest& req, int bundle,
                                  v1::VerifyResponse* resp) {
  if (t.stream) {
    if (!t.stream->Write(req) || !t.stream->Read(resp)) {
      t.stream->WritesDone();
      const grpc::Status st = t.stream->Finish();
      GiveUp(st.ok() ? grpc::StatusCode::UNAVAILABLE : st.error_code(),
             st.ok() ? "stream ended early" : st.error_message(), 1);
      return CallResult::kTransportBroken;
    }
  } else if (t.chan) {
    const absl::Status st = t.chan->Call(req, resp, absl::Now() + absl::Seconds(g_.timeout_s));
    if (!st.ok()) {
      GiveUp(static_cast<int>(st.code()), std::string(st.message()), 1);
      return CallResult::kTransportBroken;
    }
  } else {
    auto ctx = MakeContext(g_, false);
    grpc::Status st;
    if (t.pieces_caller) {
      st = t.pieces_caller->Verify(ctx.get(), SerializeRequestAround(req, w_.bulks[bundle]), resp);
    } else {
      DeclareRequestBytes(ctx.get(), req.ByteSizeLong());
      st = stub_.Verify(ctx.get(), req, resp);
    }
    if (!st.ok()) {
      tally_.Err(st.error_code(), st.error_message());
      return CallResult::kFailed;
    }
    return CallResult::kOk;
  }
  // Streams and channels answer a failed call in band.
  if (resp->error_code() != 0) {
    tally_.Err(resp->error_code(), resp->error_message());
    return CallResult::kFailed;
  }
  return CallResult::kOk;
}

// --check: the output the region holds against the inline transport's for the same bundle.
void Workers::CheckOutput(int slot, int bundle, int64_t n, const v1::VerifyResponse& resp) {
  const v1::VerifyResponse& want = inline_out_[bundle];
  absl::StatusOr<std::string> o = region_->Output(slot);
  if (!o.ok()) {
    tally_.Err(static_cast<int>(o.status().code()), std::string(o.status().message()));
  } else if (want.served_path() != resp.served_path()) {
    std::lock_guard<std::mutex> l(tally_.mu);
    ++tally_.unchecked;
  } else if (*o != want.o().raw_contents()) {
    tally_.Err(grpc::StatusCode::DATA_LOSS,
               fmt::format("--check: call {}: o in the region differs from the inline "
                           "transport's",
                           n));
  } else {
    std::lock_guard<std::mutex> l(tally_.mu);
    ++tally_.checked;
  }
}

// The run's figures, as both the text and the --json summary give them.
struct Summary {
  int64_t nok = 0, nerr = 0;
  double wall = 0;
  double p50 = 0, p90 = 0, p99 = 0, max = 0;  // call latency seconds, as the client saw them
  double server_p50 = 0;
};

Summary Summarize(const Tally& tally, double wall) {
  Summary m;
  for (const auto& [k, v] : tally.errors) m.nerr += v;
  m.nok = static_cast<int64_t>(tally.latency_s.size());
  m.wall = wall;
  const auto& lat = tally.latency_s;
  m.p50 = Percentile(lat, 0.5);
  m.p90 = Percentile(lat, 0.9);
  m.p99 = Percentile(lat, 0.99);
  m.max = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  m.server_p50 = Percentile(tally.server_s, 0.5);
  return m;
}

void PrintSummaryJson(const SendOptions& s, const Workload& w, const ClientEncode& enc,
                      const Tally& tally, const Summary& m) {
  PrintJson({{"shape", s.shape},
             {"page_size", s.page_size},
             {"count", s.count},
             {"transport", s.transport},
             {"inline_encode", w.around ? "pieces" : "message"},
             {"checked", tally.checked},
             {"unchecked", tally.unchecked},
             {"scribble", s.scribble},
             {"resident", s.resident},
             {"distinct", w.distinct},
             {"traffic", s.traffic},
             {"kv_dtype", s.kv_dtype},
             {"kv_scale", s.kv_scale},
             {"concurrency", s.concurrency},
             {"stream", s.stream},
             {"channel", s.channel},
             {"bundle_bytes", enc.bundle_bytes},
             {"ok", m.nok},
             {"failed", m.nerr},
             {"errors", tally.errors},
             {"first_error", tally.first_error},
             {"served", tally.served},
             {"wall_seconds", m.wall},
             {"calls_per_second", tally.latency_s.size() / m.wall},
             {"latency_seconds", {{"p50", m.p50}, {"p90", m.p90}, {"p99", m.p99}, {"max", m.max}}},
             {"server_seconds_p50", m.server_p50},
             {"client_encode_seconds", Percentile(enc.seconds, 0.5)},
             {"server_stage_seconds_p50",
              {{"decode", Percentile(tally.decode_s, 0.5)},
               {"prepare", Percentile(tally.prepare_s, 0.5)},
               {"served_path", Percentile(tally.served_path_s, 0.5)},
               {"served_device", Percentile(tally.served_device_s, 0.5)},
               {"fetch", Percentile(tally.fetch_s, 0.5)},
               {"parse", Percentile(tally.parse_s, 0.5)}}}});
}

void PrintSummaryText(const GlobalOptions& g, const SendOptions& s, const Workload& w,
                      const ClientEncode& enc, const Tally& tally, const Summary& m) {
  const int distinct = w.distinct;
  std::cout << fmt::format(
      "{} calls of shape {} ({:.1f} MB each, page_size {}) to {}, concurrency {}{}, transport "
      "{}\n",
      s.count, s.shape, enc.bundle_bytes / 1e6, s.page_size, g.target, s.concurrency,
      s.stream ? ", streaming" : (s.channel ? ", through call channels" : ""), s.transport);
  if (s.check) {
    std::cout << fmt::format(
        "check: {} outputs equal the inline transport's bit for bit, {} "
        "served by another path (not compared)\n",
        tally.checked, tally.unchecked);
  }
  std::cout << fmt::format("{} traffic, {} distinct bundle{} reused round-robin{}\n", s.traffic,
                           distinct, distinct == 1 ? "" : "s",
                           distinct < s.count ? " (raise --distinct for detection work)" : "");
  std::cout << fmt::format("succeeded {}  failed {}  {:.1f} calls/s over {:.2f} s\n", m.nok, m.nerr,
                           m.nok / m.wall, m.wall);
  if (m.nerr) {
    std::cout << "failed by code";
    for (const auto& [k, v] : tally.errors) std::cout << fmt::format("  {} {}", k, v);
    std::cout << "\n";
  }
  std::cout << fmt::format(
      "latency ms  p50 {:.2f}  p90 {:.2f}  p99 {:.2f}  max {:.2f}   (server p50 {:.2f})\n",
      m.p50 * 1e3, m.p90 * 1e3, m.p99 * 1e3, m.max * 1e3, m.server_p50 * 1e3);
  std::cout << fmt::format(
      "server p50 ms  parse {:.3f}  decode {:.3f}  prepare {:.3f}  served path {:.3f} (its "
      "own work {:.3f})  fetch {:.3f}   (client encode {:.3f})\n",
      Percentile(tally.parse_s, 0.5) * 1e3, Percentile(tally.decode_s, 0.5) * 1e3,
      Percentile(tally.prepare_s, 0.5) * 1e3, Percentile(tally.served_path_s, 0.5) * 1e3,
      Percentile(tally.served_device_s, 0.5) * 1e3, Percentile(tally.fetch_s, 0.5) * 1e3,
      Percentile(enc.seconds, 0.5) * 1e3);
  std::cout << "served";
  for (const auto& [k, v] : tally.served) std::cout << fmt::format("  {} {}", k, v);
  std::cout << "\n";
  if (m.nerr) std::cout << "first error: " << tally.first_error << "\n";
}

}  // namespace

int RunSend(const GlobalOptions& g, const SendOptions& s) {
  std::vector<int64_t> dims;
  Traffic traffic;
  SendTransport transport;
  if (const std::string bad = CheckOptions(s, &dims, &traffic, &transport); !bad.empty()) {
    return Fail(g, "send", bad);
  }
  const bool regions = transport != SendTransport::kInline;
  Workload w;
  MakeWorkload(s, dims, traffic, regions, &w);
  const ClientEncode enc = TimeClientEncode(w);

  const std::shared_ptr<grpc::Channel> channel = MakeChannel(g, g.target);
  auto stub = v1::VerifyService::NewStub(channel);
  // Region transports: the memory, registered once, one slot per worker; with --check, each
  // bundle's inline output to compare with.
  std::unique_ptr<SendRegion> region;
  std::vector<v1::VerifyResponse> inline_out(s.check ? w.distinct : 0);
  if (regions) {
    auto r = SendRegion::Create(transport, *stub, g, s.concurrency, w.bundles[0]->view(), s.device,
                                s.want_lse);
    if (!r.ok()) return Fail(g, "send", std::string(r.status().message()));
    region = std::move(*r);
    for (size_t i = 0; i < inline_out.size(); ++i) {
      auto ctx = MakeContext(g, false);
      DeclareRequestBytes(ctx.get(), w.requests[i].ByteSizeLong());
      grpc::Status st = stub->Verify(ctx.get(), w.requests[i], &inline_out[i]);
      if (!st.ok()) return Fail(g, "send --check (the inline call)", st, false);
    }
  }
  Tally tally;
  const auto t0 = Clock::now();
  Workers(g, s, w, channel, *stub, region.get(), inline_out, &tally).Run();
  const Summary m = Summarize(tally, std::chrono::duration<double>(Clock::now() - t0).count());
  if (!tally.first_error.empty()) {
    tally.first_error =
        CodeName(tally.first_code) + ": " +
        WithHint(tally.first_message, AddressHint(g, false, tally.first_code, tally.first_message));
  }
  // No worker could open its call channel (a TCP target, a daemon without channels): the error,
  // not a summary of zero latencies.
  if (m.nok == 0 && tally.channel_refused) return Fail(g, "send", tally.first_error);
  if (g.json) {
    PrintSummaryJson(s, w, enc, tally, m);
  } else {
    PrintSummaryText(g, s, w, enc, tally, m);
  }
  return m.nerr == 0 && tally.errors.empty() && m.nok == s.count ? 0 : 1;
}

void AddSendOptions(CLI::App* app, SendOptions* send) {
  app->add_option("--shape", send->shape, "B,T,H,PREFIX")->capture_default_str();
  app->add_option("--page_size", send->page_size, "tokens per KV page")->capture_default_str();
  app->add_option("--count", send->count, "calls to send")->capture_default_str();
  app->add_option("--concurrency", send->concurrency, "calls in flight")->capture_default_str();
  app->add_option("--tree", send->tree, "tree (random draft tree) or chain")->capture_default_str();
  app->add_option("--traffic", send->traffic,
                  "random (q independent of K: diffuse attention) or realistic (sinks, recency, "
                  "heavy hitters, draft tokens that matter)")
      ->capture_default_str();
  app->add_option("--seed", send->seed, "seed of the first bundle")->capture_default_str();
  app->add_option("--kv_dtype", send->kv_dtype,
                  "the KV pool: bf16, or e4m3 (the same random values quantised at --kv_scale)")
      ->capture_default_str();
  app->add_option("--kv_scale", send->kv_scale, "an e4m3 pool's scale")->capture_default_str();
  app->add_option("--distinct", send->distinct,
                  "distinct bundles, encoded once and reused round-robin. NOTE: the default 4 is "
                  "for load tests; a fault that shows only on some inputs is sampled on those 4 "
                  "only, so use --distinct equal to --count for detection work")
      ->capture_default_str();
  app->add_option("--request_id_prefix", send->request_id_prefix, "request ids PREFIX-N");
  app->add_flag("--stream", send->stream, "use the bidirectional stream");
  app->add_flag("--channel", send->channel,
                "send through call channels (one per worker: a shared-memory request slot with a "
                "futex doorbell, no gRPC call per verify); needs a unix: target");
  app->add_flag("--want_lse", send->want_lse, "ask for lse too");
  app->add_flag("--compare_sync", send->compare_sync, "compare before responding");
  app->add_option("--transport", send->transport,
                  "inline, shm (a POSIX shm region verifyctl creates) or cuda_ipc (GPU memory "
                  "verifyctl allocates, shared by CUDA IPC); regions need a unix: target")
      ->capture_default_str();
  app->add_option("--inline_encode", send->inline_encode,
                  "inline unary calls: pieces (q and the pool sent from where they are) or message "
                  "(copied into the request message, then serialized)")
      ->capture_default_str();
  app->add_option("--device", send->device, "the request's GPU (and the cuda_ipc region's)")
      ->capture_default_str();
  app->add_flag("--check", send->check,
                "region transports: each output must equal the inline transport's bit for bit");
  app->add_flag("--scribble", send->scribble,
                "region transports: overwrite q and the pool right after each response, as a "
                "client reusing its buffers");
  app->add_flag("--resident", send->resident,
                "region transports: each worker writes its bundle into its slot once and calls "
                "with it every time (a stack whose KV pool stays resident): calls back to back");
}

}  // namespace verifyd::cli
