#include "src/channel/channel_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/channel/futex_word.h"
#include "src/channel/shm_object.h"

namespace verifyd::channel {
namespace {

std::atomic<int> next_object{0};

absl::Status FromGrpc(const grpc::Status& st) {
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
}

// Gives the object `key` to the group of the Unix socket `peer` (a call's peer) when that socket
// admits its group and this process is in it (shm_object.h). False when nothing was shared.
bool ShareWithSocketGroup(const std::string& key, const std::string& peer) {
  const std::optional<gid_t> group = SocketGroup(peer);
  if (!group) return false;
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  const bool shared = ShareWithGroup(fd, *group);
  close(fd);
  return shared;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChannelClient>> ChannelClient::Open(v1::VerifyService::Stub& stub,
                                                                   ContextFactory make_context,
                                                                   ChannelClientOptions o) {
  std::unique_ptr<ChannelClient> c(new ChannelClient(stub, std::move(make_context), std::move(o)));
  if (absl::Status st = c->Create(); !st.ok()) return st;
  v1::OpenChannelRequest req;
  req.set_name(c->opts_.name);
  req.set_key(c->key_);
  req.set_byte_size(c->opts_.byte_size);
  req.set_client(c->opts_.client);
  v1::OpenChannelResponse resp;
  auto ctx = c->make_context_();
  grpc::Status st = stub.OpenChannel(ctx.get(), req, &resp);
  // A verifyd running as another user cannot open a 0600 object: give it the group of the socket
  // the call reached and ask once more. That socket is known only from the call's peer, since the
  // options do not carry verifyd's address.
  if (st.error_code() == grpc::StatusCode::PERMISSION_DENIED &&
      ShareWithSocketGroup(c->key_, ctx->peer())) {
    ctx = c->make_context_();
    st = stub.OpenChannel(ctx.get(), req, &resp);
  }
  if (!st.ok()) return FromGrpc(st);
  c->geometry_.capacity = resp.capacity();
  c->geometry_.request_offset = resp.request_offset();
  c->geometry_.response_offset = resp.response_offset();
  c->open_ = true;
  // The answer must describe this object: verifyd wrote the same numbers into its header.
  const Header* h = HeaderOf(c->base_);
  if (h->magic != kMagic || h->version != kVersion || h->capacity != resp.capacity() ||
      resp.request_offset() < kHeaderBytes ||
      resp.response_offset() < resp.request_offset() + resp.capacity() ||
      resp.response_offset() + resp.capacity() > c->opts_.byte_size) {
    return absl::InternalError(absl::StrCat("channel '", c->opts_.name,
                                            "': verifyd's answer does not match the header it "
                                            "wrote (version ",
                                            h->version, ")"));
  }
  // Both sides map the object now: its name can go, so that a client that dies leaves nothing in
  // /dev/shm (the memory lives until the last mapping goes).
  shm_unlink(c->key_.c_str());
  return c;
}

absl::Status ChannelClient::Create() {
  // The pid alone does not make the name unique: a process that died without unlinking leaves
  // its object behind, and a later process may get the same pid. A random part, and another try
  // where a name is taken all the same, keep a stale object from blocking the channel.
  std::random_device rd;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    key_ = absl::StrCat("/verifyd-ch-", getpid(), "-", next_object.fetch_add(1), "-",
                        absl::Hex(rd(), absl::kZeroPad8));
    fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open ", key_, ": ", strerror(errno)));
  absl::Status st;
  if (ftruncate(fd, static_cast<off_t>(opts_.byte_size)) != 0) {
    st = absl::ResourceExhaustedError(
        absl::StrCat("ftruncate ", key_, " to ", opts_.byte_size, " bytes: ", strerror(errno)));
  } else {
    void* m = mmap(nullptr, opts_.byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      st = absl::ResourceExhaustedError(absl::StrCat("mmap ", key_, ": ", strerror(errno)));
    } else {
      base_ = static_cast<char*>(m);
    }
  }
  close(fd);
  if (!st.ok()) shm_unlink(key_.c_str());
  return st;
}

ChannelClient::~ChannelClient() {
  if (open_) {
    v1::CloseChannelRequest req;
    req.set_name(opts_.name);
    v1::CloseChannelResponse resp;
    auto ctx = make_context_();
    stub_.CloseChannel(ctx.get(), req, &resp);  // verifyd may be gone: nothing to close then
  }
  if (base_ != nullptr) {
    munmap(base_, opts_.byte_size);
    shm_unlink(key_.c_str());
  }
}

absl::Status ChannelClient::Call(const v1::VerifyRequest& req, v1::VerifyResponse* resp,
                                 absl::Time deadline) {
  if (!broken_.ok()) return broken_;
  Header* h = HeaderOf(base_);
  if (h->state.load(std::memory_order_acquire) != kStateOpen) {
    return absl::UnavailableError(absl::StrCat("channel '", opts_.name, "': closed by verifyd"));
  }
  const size_t bytes = req.ByteSizeLong();
  if (bytes > geometry_.capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("channel '", opts_.name, "': the request of ", bytes,
                     " bytes does not fit its ", geometry_.capacity,
                     "-byte request area (name regions instead of inline tensors, or "
                     "open a larger channel)"));
  }
  req.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(base_ + geometry_.request_offset));
  h->request_bytes.store(static_cast<uint32_t>(bytes), std::memory_order_relaxed);
  const uint32_t seq = ++seq_;
  h->request_seq.store(seq, std::memory_order_release);
  FutexWake(&h->request_seq);
  // The answer to this call sets response_seq to `seq`; the previous value is seq - 1.
  const uint32_t got = AwaitChange(
      &h->response_seq, seq - 1, opts_.spin, absl::Milliseconds(100),
      [h] { return h->state.load(std::memory_order_acquire) != kStateOpen; }, deadline);
  if (got != seq) {
    if (h->state.load(std::memory_order_acquire) != kStateOpen) {
      broken_ =
          absl::UnavailableError(absl::StrCat("channel '", opts_.name, "': closed by verifyd"));
    } else {
      broken_ = absl::DeadlineExceededError(
          absl::StrCat("channel '", opts_.name,
                       "': no answer before the deadline; the channel "
                       "is unusable now (an answer may still come): open a new one"));
    }
    return broken_;
  }
  const uint32_t out = h->response_bytes.load(std::memory_order_relaxed);
  if (out > geometry_.capacity ||
      !resp->ParseFromArray(base_ + geometry_.response_offset, static_cast<int>(out))) {
    return absl::DataLossError(
        absl::StrCat("channel '", opts_.name, "': the answer could not be parsed"));
  }
  return absl::OkStatus();
}

}  // namespace verifyd::channel
