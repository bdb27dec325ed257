#include "src/cli/send_command.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "fmt/format.h"
#include "src/bundle/random_bundle.h"
#include "src/bundle/request_codec.h"
#include "src/cli/cli_common.h"
#include "src/cli/pieces_call.h"
#include "src/channel/channel_client.h"
#include "src/cli/send_regions.h"
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
  int64_t checked = 0, unchecked = 0;  // --check: outputs compared with inline / not comparable

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
    if (first_error.empty()) first_error = name + ": " + msg;
  }
};

}  // namespace

int RunSend(const GlobalOptions& g, const SendOptions& s) {
  std::vector<int64_t> dims;
  for (auto part : absl::StrSplit(s.shape, ',')) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) return Fail(g, "send", "--shape: expected B,T,H,PREFIX");
    dims.push_back(v);
  }
  if (dims.size() != 4) return Fail(g, "send", "--shape: expected B,T,H,PREFIX");
  if (s.count < 1 || s.concurrency < 1) {
    return Fail(g, "send", "--count and --concurrency must be >= 1");
  }
  if (s.tree != "tree" && s.tree != "chain") return Fail(g, "send", "--tree: tree or chain");
  Traffic traffic;
  if (!ParseTraffic(s.traffic, &traffic)) {
    return Fail(g, "send", "--traffic: random or realistic");
  }

  SendTransport transport;
  if (!ParseSendTransport(s.transport, &transport)) {
    return Fail(g, "send", "--transport: inline, shm or cuda_ipc");
  }
  const bool regions = transport != SendTransport::kInline;
  if (s.inline_encode != "pieces" && s.inline_encode != "message") {
    return Fail(g, "send", "--inline_encode: pieces or message");
  }
  if (s.channel && s.stream) return Fail(g, "send", "--channel and --stream: choose one");
  if ((s.check || s.scribble || s.resident) && !regions) {
    return Fail(g, "send", "--check, --scribble and --resident need --transport shm or cuda_ipc");
  }
  if (s.scribble && s.resident) {
    return Fail(g, "send", "--scribble and --resident: choose one (scribbling overwrites what "
                           "stays resident)");
  }

  // Encode a few distinct bundles once; the workers reuse them. Inline unary calls send q and the
  // pool from the bundle's own memory (SerializeRequestAround), as a serving stack's client would:
  // not copied into the message, nor into a serialized buffer.
  const int distinct = static_cast<int>(std::clamp<int64_t>(s.distinct, 1, s.count));
  const bool around = !regions && !s.channel && !s.stream && s.inline_encode == "pieces";
  std::vector<v1::VerifyRequest> requests(distinct);
  std::vector<InPlaceTensors> bulks(distinct);
  std::vector<std::unique_ptr<RandomBundle>> bundles;
  for (int i = 0; i < distinct; ++i) {
    RandomBundleSpec spec;
    spec.batch = static_cast<int>(dims[0]);
    spec.draft = static_cast<int>(dims[1]);
    spec.heads = static_cast<int>(dims[2]);
    spec.prefix = dims[3];
    spec.page_size = s.page_size;
    spec.tree = s.tree == "chain" ? TreeKind::kChain : TreeKind::kRandomTree;
    spec.traffic = traffic;
    spec.seed = s.seed + i;
    const RandomBundle& b = *bundles.emplace_back(std::make_unique<RandomBundle>(spec));
    EncodeRequest(b.view(), &requests[i], around ? &bulks[i] : nullptr);
    requests[i].set_want_lse(s.want_lse);
    requests[i].set_compare_sync(s.compare_sync);
    requests[i].set_device(s.device);
  }

  // The client's own encoding of one call (what gRPC does to the message before sending it, or
  // the pieces it sends), and the bytes a call carries (every bundle has the same shape).
  std::vector<double> encode_s;
  int64_t bundle_bytes = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t = Clock::now();
    const uint64_t bytes = around ? SerializeRequestAround(requests[0], bulks[0]).size()
                                  : requests[0].SerializeAsString().size();
    bundle_bytes = static_cast<int64_t>(bytes);
    encode_s.push_back(std::chrono::duration<double>(Clock::now() - t).count());
  }

  const std::shared_ptr<grpc::Channel> channel = MakeChannel(g.target);
  auto stub = v1::VerifyService::NewStub(channel);
  // Region transports: the memory, registered once, one slot per worker; with --check, each
  // bundle's inline output to compare with.
  std::unique_ptr<SendRegion> region;
  std::vector<v1::VerifyResponse> inline_out(s.check ? distinct : 0);
  if (regions) {
    auto r = SendRegion::Create(transport, *stub, g, s.concurrency, bundles[0]->view(), s.device,
                                s.want_lse);
    if (!r.ok()) return Fail(g, "send", std::string(r.status().message()));
    region = std::move(*r);
    for (size_t i = 0; i < inline_out.size(); ++i) {
      auto ctx = MakeContext(g, false);
      grpc::Status st = stub->Verify(ctx.get(), requests[i], &inline_out[i]);
      if (!st.ok()) return Fail(g, "send --check (the inline call)", st);
    }
  }
  Tally tally;
  std::atomic<int64_t> next{0};
  const auto t0 = Clock::now();
  std::atomic<int> next_slot{0};
  // A channel's areas hold the largest request and its response (o and lse inline unless the
  // call names o_out).
  uint64_t channel_bytes = 0;
  if (s.channel) {
    uint64_t area = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      const BundleView& v = bundles[i]->view();
      const uint64_t rows = static_cast<uint64_t>(v.rows()) * v.shape.heads;
      area = std::max<uint64_t>(area, std::max<uint64_t>(requests[i].ByteSizeLong(),
                                                         rows * (512 * 2 + 4)));
    }
    channel_bytes = channel::kHeaderBytes + 2 * (area + (64 << 10));
  }
  // A worker whose transport broke fails `held` calls (0, or the one in hand) and every call no
  // other worker has taken yet.
  auto give_up = [&](int code, const std::string& why, int64_t held) {
    tally.Err(code, why, held + std::max<int64_t>(0, s.count - next.exchange(s.count)));
  };
  std::barrier opened(static_cast<std::ptrdiff_t>(s.concurrency));
  auto worker = [&] {
    const int slot = next_slot.fetch_add(1);
    std::unique_ptr<channel::ChannelClient> chan;
    if (s.channel) {
      channel::ChannelClientOptions co;
      co.name = fmt::format("verifyctl-{}-{}", getpid(), slot);
      co.byte_size = channel_bytes;
      co.client = fmt::format("verifyctl-{}", getpid());
      auto c = channel::ChannelClient::Open(*stub, [&g] { return MakeContext(g, false); }, co);
      if (!c.ok()) {
        give_up(static_cast<int>(c.status().code()),
                "OpenChannel: " + std::string(c.status().message()), 0);
        opened.arrive_and_drop();
        return;
      }
      chan = std::move(*c);
    }
    std::optional<PiecesCaller> pieces_caller;
    if (around) pieces_caller.emplace(channel);
    std::unique_ptr<grpc::ClientContext> sctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream;
    if (s.stream) {
      sctx = MakeContext(g, false);
      sctx->set_deadline(std::chrono::system_clock::time_point::max());
      stream = stub->VerifyStream(sctx.get());
    }
    // Calls start once every worker has its transport: opening one is not part of the calls.
    opened.arrive_and_wait();
    std::optional<v1::VerifyRequest> resident;  // --resident: the call naming the staged slot
    int bundle = 0;                             // the bundle in the slot
    for (int64_t n; (n = next.fetch_add(1)) < s.count;) {
      if (!resident) bundle = static_cast<int>(n % distinct);
      v1::VerifyRequest req = resident ? *resident : requests[bundle];
      if (region && !resident) {
        if (absl::Status st = region->Stage(slot, bundles[bundle]->view(), &req); !st.ok()) {
          tally.Err(static_cast<int>(st.code()), std::string(st.message()));
          continue;
        }
        if (s.resident) resident = req;
      }
      if (!s.request_id_prefix.empty()) req.set_request_id(fmt::format("{}-{}", s.request_id_prefix, n));
      v1::VerifyResponse resp;
      const auto t = Clock::now();
      if (stream) {
        if (!stream->Write(req) || !stream->Read(&resp)) {
          stream->WritesDone();
          const grpc::Status st = stream->Finish();
          give_up(st.ok() ? grpc::StatusCode::UNAVAILABLE : st.error_code(),
                  st.ok() ? "stream ended early" : st.error_message(), 1);
          return;
        }
        if (resp.error_code() != 0) {
          tally.Err(resp.error_code(), resp.error_message());
          continue;
        }
      } else if (chan) {
        const absl::Status st =
            chan->Call(req, &resp, absl::Now() + absl::Seconds(g.timeout_s));
        if (!st.ok()) {
          give_up(static_cast<int>(st.code()), std::string(st.message()), 1);
          return;
        }
        if (resp.error_code() != 0) {
          tally.Err(resp.error_code(), resp.error_message());
          continue;
        }
      } else {
        auto ctx = MakeContext(g, false);
        grpc::Status st = pieces_caller ? pieces_caller->Verify(
                                              ctx.get(), SerializeRequestAround(req, bulks[bundle]),
                                              &resp)
                                        : stub->Verify(ctx.get(), req, &resp);
        if (!st.ok()) {
          tally.Err(st.error_code(), st.error_message());
          continue;
        }
      }
      tally.Ok(std::chrono::duration<double>(Clock::now() - t).count(), resp);
      if (region && s.check) {
        const v1::VerifyResponse& want = inline_out[bundle];
        absl::StatusOr<std::string> o = region->Output(slot);
        if (!o.ok()) {
          tally.Err(static_cast<int>(o.status().code()), std::string(o.status().message()));
        } else if (want.served_path() != resp.served_path()) {
          std::lock_guard<std::mutex> l(tally.mu);
          ++tally.unchecked;
        } else if (*o != want.o().raw_contents()) {
          tally.Err(grpc::StatusCode::DATA_LOSS,
                    fmt::format("--check: call {}: o in the region differs from the inline "
                                "transport's",
                                n));
        } else {
          std::lock_guard<std::mutex> l(tally.mu);
          ++tally.checked;
        }
      }
      if (region && s.scribble) {
        if (absl::Status st = region->Scribble(slot); !st.ok()) {
          tally.Err(static_cast<int>(st.code()), std::string(st.message()));
        }
      }
    }
    if (stream) {
      stream->WritesDone();
      if (const grpc::Status st = stream->Finish(); !st.ok()) {
        tally.Err(st.error_code(), "stream: " + st.error_message(), 0);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < s.concurrency; ++i) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();

  int64_t nerr = 0;
  for (const auto& [k, v] : tally.errors) nerr += v;
  const int64_t nok = static_cast<int64_t>(tally.latency_s.size());
  const auto& lat = tally.latency_s;
  const double p50 = Percentile(lat, 0.5), p90 = Percentile(lat, 0.9), p99 = Percentile(lat, 0.99);
  const double mx = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  const double srv50 = Percentile(tally.server_s, 0.5);
  if (g.json) {
    PrintJson({{"shape", s.shape}, {"page_size", s.page_size}, {"count", s.count},
               {"transport", s.transport}, {"inline_encode", around ? "pieces" : "message"},
               {"checked", tally.checked},
               {"unchecked", tally.unchecked}, {"scribble", s.scribble},
               {"resident", s.resident},
               {"distinct", distinct}, {"traffic", s.traffic},
               {"concurrency", s.concurrency}, {"stream", s.stream}, {"channel", s.channel},
               {"bundle_bytes", bundle_bytes}, {"ok", nok}, {"failed", nerr},
               {"errors", tally.errors}, {"first_error", tally.first_error},
               {"served", tally.served}, {"wall_seconds", wall},
               {"calls_per_second", lat.size() / wall},
               {"latency_seconds", {{"p50", p50}, {"p90", p90}, {"p99", p99}, {"max", mx}}},
               {"server_seconds_p50", srv50},
               {"client_encode_seconds", Percentile(encode_s, 0.5)},
               {"server_stage_seconds_p50",
                {{"decode", Percentile(tally.decode_s, 0.5)},
                 {"prepare", Percentile(tally.prepare_s, 0.5)},
                 {"served_path", Percentile(tally.served_path_s, 0.5)},
                 {"served_device", Percentile(tally.served_device_s, 0.5)},
                 {"fetch", Percentile(tally.fetch_s, 0.5)},
                 {"parse", Percentile(tally.parse_s, 0.5)}}}});
  } else {
    std::cout << fmt::format(
        "{} calls of shape {} ({:.1f} MB each, page_size {}) to {}, concurrency {}{}, transport "
        "{}\n",
        s.count, s.shape, bundle_bytes / 1e6, s.page_size, g.target, s.concurrency,
        s.stream ? ", streaming" : (s.channel ? ", through call channels" : ""), s.transport);
    if (s.check) {
      std::cout << fmt::format("check: {} outputs equal the inline transport's bit for bit, {} "
                               "served by another path (not compared)\n",
                               tally.checked, tally.unchecked);
    }
    std::cout << fmt::format("{} traffic, {} distinct bundle{} reused round-robin{}\n", s.traffic,
                             distinct, distinct == 1 ? "" : "s",
                             distinct < s.count ? " (raise --distinct for detection work)" : "");
    std::cout << fmt::format("succeeded {}  failed {}  {:.1f} calls/s over {:.2f} s\n", nok,
                             nerr, nok / wall, wall);
    if (nerr) {
      std::cout << "failed by code";
      for (const auto& [k, v] : tally.errors) std::cout << fmt::format("  {} {}", k, v);
      std::cout << "\n";
    }
    std::cout << fmt::format(
        "latency ms  p50 {:.2f}  p90 {:.2f}  p99 {:.2f}  max {:.2f}   (server p50 {:.2f})\n",
        p50 * 1e3, p90 * 1e3, p99 * 1e3, mx * 1e3, srv50 * 1e3);
    std::cout << fmt::format(
        "server p50 ms  parse {:.3f}  decode {:.3f}  prepare {:.3f}  served path {:.3f} (its "
        "own work {:.3f})  fetch {:.3f}   (client encode {:.3f})\n",
        Percentile(tally.parse_s, 0.5) * 1e3, Percentile(tally.decode_s, 0.5) * 1e3,
        Percentile(tally.prepare_s, 0.5) * 1e3, Percentile(tally.served_path_s, 0.5) * 1e3,
        Percentile(tally.served_device_s, 0.5) * 1e3, Percentile(tally.fetch_s, 0.5) * 1e3,
        Percentile(encode_s, 0.5) * 1e3);
    std::cout << "served";
    for (const auto& [k, v] : tally.served) std::cout << fmt::format("  {} {}", k, v);
    std::cout << "\n";
    if (nerr) std::cout << "first error: " << tally.first_error << "\n";
  }
  return nerr == 0 && tally.errors.empty() && nok == s.count ? 0 : 1;
}

}  // namespace verifyd::cli
