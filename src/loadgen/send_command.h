#pragma once
// verifyctl send: a traffic generator of random bundles with a latency summary.

#include <cstdint>
#include <string>

#include "src/cli/cli_common.h"

namespace CLI {
class App;
}  // namespace CLI

namespace verifyd::cli {

struct SendOptions {
  std::string shape = "4,16,8,4096";  // B,T,H,PREFIX
  int page_size = 64;
  int64_t count = 20;
  int concurrency = 1;
  std::string tree = "tree";  // tree or chain
  uint64_t seed = 1;
  int distinct = 4;                // distinct random bundles, reused round-robin (see --distinct)
  std::string traffic = "random";  // random (diffuse attention) or realistic (concentrated)
  std::string kv_dtype = "bf16";   // the pool: bf16, or e4m3 at kv_scale
  float kv_scale = 1.f;
  bool stream = false;   // one bidirectional stream per worker instead of unary calls
  bool channel = false;  // one call channel per worker (shared memory + futex, no gRPC call)
  bool want_lse = false;
  bool compare_sync = false;
  std::string request_id_prefix;     // request ids PREFIX-N (canary stays stable per id)
  std::string transport = "inline";  // inline, shm or cuda_ipc (see send_regions.h)
  // Inline unary calls: "pieces" sends q and the pool from the bundle's memory
  // (SerializeRequestAround); "message" copies them into the request message first, as the
  // generated stub sends it.
  std::string inline_encode = "pieces";
  int device = 0;         // the request's device (and the cuda_ipc region's GPU)
  bool check = false;     // region transports: o must equal the inline transport's bit for bit
  bool scribble = false;  // region transports: overwrite q and the pool after each response
  // Region transports: each worker writes its bundle into its slot once and names it in every
  // call (a stack whose pool stays resident), so calls come back to back.
  bool resident = false;
};

int RunSend(const GlobalOptions& g, const SendOptions& s);

// The send options, on verifyctl's send subcommand.
void AddSendOptions(CLI::App* app, SendOptions* send);

}  // namespace verifyd::cli
