#pragma once
// Where `verifyctl send --transport shm|cuda_ipc` keeps its calls' tensors: memory verifyctl
// allocates itself (a POSIX shared-memory object, or GPU memory shared through CUDA IPC),
// registered with the daemon once, with one slot per worker. Before each call a worker writes its
// bundle into its slot (finished before the call is sent) and the call names the slot; verifyd
// writes o (and lse) into the slot and the response carries no tensor bytes.
//   shm: every tensor in the slot.
//   cuda_ipc: q, kv_pool, o and lse in GPU memory; the small index tensors and the mask inline.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/bundle/bundle.h"
#include "src/cli/cli_common.h"
#include "verifyd/v1/verify.grpc.pb.h"

namespace verifyd::cli {

enum class SendTransport { kInline, kShm, kCudaIpc };
bool ParseSendTransport(const std::string& name, SendTransport* out);

class SendRegion {
 public:
  // Room for `slots` calls shaped like `shape_of`, on GPU `device` for cuda_ipc; registered
  // through `stub` under a name unique to this process.
  static absl::StatusOr<std::unique_ptr<SendRegion>> Create(SendTransport t,
                                                            v1::VerifyService::Stub& stub,
                                                            const GlobalOptions& g, int slots,
                                                            const BundleView& shape_of, int device,
                                                            bool want_lse);
  ~SendRegion();  // unregisters and frees
  SendRegion(const SendRegion&) = delete;
  SendRegion& operator=(const SendRegion&) = delete;

  // Writes `v` into `slot` and turns `req` (encoded inline from `v`) into one that names it.
  absl::Status Stage(int slot, const BundleView& v, v1::VerifyRequest* req);
  // Overwrites the slot's q and pool with NaN: a client that reuses its buffers at once.
  absl::Status Scribble(int slot);
  // The o bytes verifyd wrote into `slot`.
  absl::StatusOr<std::string> Output(int slot) const;
  uint64_t bytes() const { return bytes_; }

 private:
  struct Layout {
    uint64_t q = 0, kv_pool = 0, kv_indptr = 0, kv_indices = 0, kv_lens = 0, tree_mask = 0, o = 0,
             lse = 0, end = 0;
  };
  SendRegion(SendTransport t, v1::VerifyService::Stub& stub, const GlobalOptions& g)
      : transport_(t), stub_(stub), g_(g) {}
  absl::Status Allocate(int device);
  absl::Status Register(int device);
  absl::Status Put(uint64_t offset, const void* src, uint64_t bytes);
  void Ref(v1::Tensor* t, uint64_t offset, uint64_t bytes) const;

  SendTransport transport_;
  v1::VerifyService::Stub& stub_;
  const GlobalOptions& g_;
  Layout layout_;
  uint64_t slot_bytes_ = 0, bytes_ = 0, o_bytes_ = 0;
  int slots_ = 0;
  bool want_lse_ = false;
  std::string name_, shm_key_;
  char* host_ = nullptr;                     // shm mapping
  [[maybe_unused]] void* device_ = nullptr;  // cuda_ipc allocation (used in CUDA builds only)
  int device_index_ = 0;
  bool registered_ = false;
};

}  // namespace verifyd::cli
