#include "tests/fuzz/fuzz_targets.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/bundle/request_codec.h"
#include "src/bundle/request_in_place.h"
#include "src/bundle/validate.h"
#include "src/channel/channel_layout.h"
#include "src/channel/doorbell_layout.h"
#include "src/channel/tap_layout.h"
#include "src/control/state_store.h"
#include "src/fleet/desired_state.h"
#include "src/fleet/rollout.h"
#include "src/fleet/rollout_plan.h"
#include "src/io/bundle_file.h"
#include "src/io/safetensors.h"
#include "src/transport/vmm_fd_payload.h"

namespace verifyd::fuzz {
namespace {

// One bf16 of q or the pool: bytes parsed in place may start at an odd address.
uint16_t Load(const uint16_t* p) {
  uint16_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Reads everything a validated bundle lets an engine read; ASan reports any byte out of bounds.
uint64_t Touch(const BundleView& v) {
  uint64_t sum = Load(v.q) + Load(v.q + v.q_elems() - 1);
  for (int b = 0; b < v.shape.batch; ++b) {
    for (int64_t t = 0; t < v.kv_lens[b]; ++t) {
      const uint16_t* row = v.KvRow(b, t);
      sum += Load(row) + Load(row + kernels::kHeadDimQK - 1);
    }
    for (int i = 0; i < v.shape.draft; ++i) {
      for (int j = 0; j < v.shape.draft; ++j) sum += v.MaskBit(b, i, j);
    }
  }
  return sum;
}

volatile uint64_t sink;

absl::Status RoundTripBroke(const std::string& what, const std::string& first,
                            const std::string& second) {
  return absl::InternalError(
      absl::StrCat(what, " does not survive a round trip: '", first, "' vs '", second, "'"));
}

}  // namespace

namespace {

// One registered shm region "r" of 1 MiB that fuzzed requests may name (shm) for any tensor.
const RegionRegistry& FuzzRegions() {
  static const RegionRegistry* registry = [] {
    auto* r = new RegionRegistry(RegionLimits{}, nullptr);
    const std::string key = absl::StrCat("/verifyd-fuzz-", getpid());
    const int fd = shm_open(key.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, 1 << 20) == 0) {
      r->RegisterShm("r", key, 0, 1 << 20, "fuzz", Peer::Tcp("fuzz")).IgnoreError();
    }
    if (fd >= 0) close(fd);
    shm_unlink(key.c_str());  // the mapping keeps it
    return r;
  }();
  return *registry;
}

}  // namespace

absl::Status Request(const uint8_t* data, size_t size) {
  // Parsed as the daemon parses a channel's call (the bulk left in place), and checked against
  // protobuf's own parse of the same bytes.
  const absl::string_view wire(reinterpret_cast<const char*>(data), size);
  v1::VerifyRequest req, whole;
  InPlaceTensors bulk;
  const bool parsed = ParseRequestInPlace(wire, &req, &bulk);
  if (parsed != whole.ParseFromArray(data, static_cast<int>(size))) {
    return absl::InternalError(
        absl::StrCat("ParseRequestInPlace says ", parsed, ", protobuf's parse the opposite"));
  }
  if (!parsed) return absl::InvalidArgumentError("message could not be parsed");
  v1::VerifyRequest restored = req;
  // mutable_*() would create the tensor: only where the bulk says there is one.
  for (auto [t, b] :
       {std::pair{bulk.q ? restored.mutable_q() : nullptr, bulk.q},
        std::pair{bulk.kv_pool ? restored.mutable_kv_pool() : nullptr, bulk.kv_pool}}) {
    if (!b) continue;
    const char* at = b->data();
    if (at < wire.data() || at + b->size() > wire.data() + wire.size()) {
      return absl::InternalError("an in-place tensor is outside the message");
    }
    if (t->contents_case() != v1::Tensor::kRawContents || !t->raw_contents().empty()) {
      return absl::InternalError("an in-place tensor's message field is not empty inline bytes");
    }
    t->set_raw_contents(std::string(*b));
  }
  if (restored.SerializeAsString() != whole.SerializeAsString()) {
    return absl::InternalError("ParseRequestInPlace differs from protobuf's parse");
  }
  // And back, as a client sends it: serialized around the bulk, it parses as the whole message.
  std::string around;
  const RequestPieces pieces = SerializeRequestAround(req, bulk);
  for (absl::string_view piece : pieces.Pieces()) {
    around.append(piece.data(), piece.size());
  }
  v1::VerifyRequest back;
  if (!back.ParseFromString(around) || back.SerializeAsString() != whole.SerializeAsString()) {
    return absl::InternalError("SerializeRequestAround does not give the request back");
  }
  DecodedRequest d;
  if (absl::Status st = DecodeRequest(req, &FuzzRegions(), Peer::Tcp("fuzz"), &d, &bulk); !st.ok())
    return st;
  sink = Touch(d.view);
  for (const auto& out : {d.o_out, d.lse_out}) {  // every byte of an output range is writable
    if (out) {
      out->data[0] = 0;
      out->data[out->byte_size - 1] = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status Safetensors(const uint8_t* data, size_t size) {
  absl::StatusOr<SafetensorsFile> file =
      ParseSafetensors(std::string_view(reinterpret_cast<const char*>(data), size), "input");
  if (!file.ok()) return file.status();
  absl::StatusOr<BundleFile> b = BundleFileFromSafetensors(std::move(*file), "input");
  if (!b.ok()) return b.status();
  if (absl::Status st = ValidateBundle(b->view); !st.ok()) return st;
  sink = Touch(b->view);
  return absl::OkStatus();
}

absl::Status State(const uint8_t* data, size_t size) {
  absl::StatusOr<PersistedState> s =
      ParseState(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!s.ok()) return s.status();
  const std::string once = SerializeState(*s);
  absl::StatusOr<PersistedState> again = ParseState(once);
  if (!again.ok()) return RoundTripBroke("state", once, again.status().ToString());
  if (const std::string twice = SerializeState(*again); twice != once) {
    return RoundTripBroke("state", once, twice);
  }
  return absl::OkStatus();
}

absl::Status DesiredState(const uint8_t* data, size_t size) {
  absl::StatusOr<fleet::DesiredState> s =
      fleet::ParseDesiredState(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!s.ok()) return s.status();
  const std::string once = fleet::SerializeDesiredState(*s);
  absl::StatusOr<fleet::DesiredState> again = fleet::ParseDesiredState(once);
  if (!again.ok()) {
    return absl::InternalError(absl::StrCat("canonical text refused: ", again.status().message()));
  }
  if (const std::string twice = fleet::SerializeDesiredState(*again); twice != once) {
    return absl::InternalError(absl::StrCat("canonical text changed: ", once, " -> ", twice));
  }
  (void)fleet::TargetFor(*s, "node-a");
  return absl::OkStatus();
}

absl::Status RolloutPlan(const uint8_t* data, size_t size) {
  absl::StatusOr<fleet::RolloutPlan> p =
      fleet::ParseRolloutPlan(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!p.ok()) return p.status();
  const std::string once = fleet::SerializeRolloutPlan(*p);
  absl::StatusOr<fleet::RolloutPlan> again = fleet::ParseRolloutPlan(once);
  if (!again.ok()) {
    return absl::InternalError(absl::StrCat("canonical text refused: ", again.status().message()));
  }
  if (const std::string twice = fleet::SerializeRolloutPlan(*again); twice != once) {
    return absl::InternalError(absl::StrCat("canonical text changed: ", once, " -> ", twice));
  }
  for (int i = -1; i < static_cast<int>(p->steps.size()); ++i) {
    const fleet::DesiredState s = fleet::PlanState(*p, i, 1, p->name);
    absl::StatusOr<fleet::DesiredState> read =
        fleet::ParseDesiredState(fleet::SerializeDesiredState(s));
    if (!read.ok()) {
      return absl::InternalError(
          absl::StrCat("step ", i, "'s desired state refused: ", read.status().message()));
    }
    if (fleet::StepOf(*p, *read) != i) {
      return absl::InternalError(
          absl::StrCat("step ", i, " reads back as step ", fleet::StepOf(*p, *read)));
    }
  }
  return absl::OkStatus();
}

absl::Status Audit(const uint8_t* data, size_t size) {
  absl::Status first = absl::OkStatus();
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  while (!rest.empty()) {
    const size_t nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    if (line.empty()) continue;  // as the audit reader skips them
    absl::StatusOr<AuditEntry> e = ParseAuditLine(line);
    if (!e.ok()) {
      first.Update(e.status());
      continue;
    }
    const std::string once = SerializeAuditEntry(*e);
    absl::StatusOr<AuditEntry> again = ParseAuditLine(once);
    if (!again.ok()) return RoundTripBroke("audit line", once, again.status().ToString());
    if (const std::string twice = SerializeAuditEntry(*again); twice != once) {
      return RoundTripBroke("audit line", once, twice);
    }
  }
  return first;
}

absl::Status Channel(const uint8_t* data, size_t size) {
  const size_t bytes = std::max<size_t>(size, channel::kMinBytes);
  absl::StatusOr<channel::Geometry> g = channel::GeometryFor(bytes, uint64_t{1} << 20);
  if (!g.ok()) return g.status();
  // The mapping verifyd reads: page-aligned, the header's words where the client left them.
  std::vector<uint64_t> mem((bytes + 7) / 8, 0);
  char* base = reinterpret_cast<char*>(mem.data());
  std::memcpy(base, data, size);
  absl::StatusOr<absl::string_view> request = channel::RequestIn(base, *g);
  if (!request.ok()) return request.status();
  const uint32_t claimed = channel::HeaderOf(base)->request_bytes.load();
  if (request->size() != claimed || request->size() > g->capacity ||
      request->data() != base + g->request_offset || g->request_offset + request->size() > bytes) {
    return absl::InternalError("the request is not inside the request area");
  }
  return Request(reinterpret_cast<const uint8_t*>(request->data()), request->size());
}

namespace {

// Two descriptors of max_batch 3, T 4, 2 heads, 40 kv_indices, naming shm region "r".
const google::protobuf::RepeatedPtrField<v1::VerifyRequest>& DoorbellDescriptors() {
  static const auto* d = [] {
    auto* out = new google::protobuf::RepeatedPtrField<v1::VerifyRequest>();
    auto tensor = [](v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, uint64_t at,
                     uint64_t bytes) {
      t->set_dtype(dtype);
      for (int64_t x : shape) t->add_shape(x);
      t->mutable_shm()->set_region("r");
      t->mutable_shm()->set_offset(at);
      t->mutable_shm()->set_byte_size(bytes);
    };
    for (int i = 0; i < 2; ++i) {
      v1::VerifyRequest* r = out->Add();
      tensor(r->mutable_q(), v1::DTYPE_BF16, {12, 2, 576}, 0, 12 * 2 * 576 * 2);
      tensor(r->mutable_kv_pool(), v1::DTYPE_BF16, {8, 16, 576}, 1 << 16, 8 * 16 * 576 * 2);
      tensor(r->mutable_kv_indices(), v1::DTYPE_I32, {40}, 1 << 18, 160);
      tensor(r->mutable_tree_mask(), v1::DTYPE_U8, {3, 4, 4}, 1 << 19, 48);
      tensor(r->mutable_o_out(), v1::DTYPE_BF16, {12, 2, 512}, (1 << 20) * (i + 1),
             12 * 2 * 512 * 2);
      r->set_sm_scale(0.1f);
    }
    return out;
  }();
  return *d;
}

int64_t Elements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t x : t.shape()) n *= x;
  return n;
}

}  // namespace

absl::Status Doorbell(const uint8_t* data, size_t size) {
  const auto& descriptors = DoorbellDescriptors();
  absl::StatusOr<channel::DoorbellPlan> plan = channel::PlanDoorbell(descriptors, 4, 4096);
  if (!plan.ok()) return absl::InternalError(plan.status().ToString());
  uint32_t word = 0;
  std::memcpy(&word, data, std::min<size_t>(size, 4));
  std::vector<char> area(4096, 0);
  if (size > 4) std::memcpy(area.data(), data + 4, std::min<size_t>(size - 4, area.size()));
  v1::VerifyRequest call;
  absl::Status st =
      channel::BuildDoorbellCall(descriptors, *plan, channel::DecodeRing(word), area.data(), &call);
  if (!st.ok()) return st;
  // What was built stays inside the descriptor's ranges and agrees with itself.
  const int64_t batch = call.kv_lens().shape(0), draft = plan->draft;
  const auto* indptr = reinterpret_cast<const int32_t*>(call.kv_indptr().raw_contents().data());
  const bool ok =
      batch >= 1 && batch <= plan->max_batch && call.kv_indptr().shape(0) == batch + 1 &&
      call.kv_indptr().raw_contents().size() == size_t(batch + 1) * 4 &&
      call.q().shape(0) == batch * draft && call.o_out().shape(0) == batch * draft &&
      call.tree_mask().shape(0) == batch && call.kv_indices().shape(0) == indptr[batch] &&
      call.q().shm().byte_size() == uint64_t(Elements(call.q())) * 2 &&
      call.o_out().shm().byte_size() == uint64_t(Elements(call.o_out())) * 2 &&
      call.kv_indices().shm().byte_size() == uint64_t(indptr[batch]) * 4 &&
      call.kv_indices().shm().byte_size() <= 160;
  return ok ? absl::OkStatus() : absl::InternalError("a built call disagrees with its layout");
}

// The fuzz target's tap: max_batch 3, T 4, 2 heads, 40 pages of 16 tokens, byte masks (records of
// 128 bytes), its pool of `kv_dtype`.
const channel::TapPlan* FuzzTapPlan(v1::DType kv_dtype) {
  v1::TapSpec spec;
  spec.set_backend("fuzz");
  spec.set_region("r");
  spec.set_slots(2);
  spec.set_max_batch(3);
  spec.set_draft(4);
  spec.set_heads(2);
  spec.set_max_pages(40);
  spec.set_page_size(16);
  spec.set_sm_scale(0.1f);
  spec.set_kv_dtype(kv_dtype);
  auto p = channel::PlanTap(spec, 4096);
  return p.ok() ? new channel::TapPlan(*p) : nullptr;
}

// One record read by a tap of each pool dtype: both accept or refuse it alike (the scale is
// checked later, as any call's), and an e4m3 call carries the record's scale bit for bit.
absl::Status Tap(const uint8_t* data, size_t size) {
  static const channel::TapPlan* plan = FuzzTapPlan(v1::DTYPE_BF16);
  static const channel::TapPlan* plan8 = FuzzTapPlan(v1::DTYPE_F8E4M3);
  if (plan == nullptr || plan8 == nullptr) {
    return absl::InternalError("the fuzz target's tap plan is refused");
  }
  static const v1::VerifyRequest slot_call = channel::TapSlotCall(*plan, 1, true);
  static const v1::VerifyRequest slot_call8 = channel::TapSlotCall(*plan8, 1, true);
  std::vector<char> record(plan->geometry.record_bytes, 0);
  std::memcpy(record.data(), data, std::min(size, record.size()));
  v1::VerifyRequest call, call8;
  uint32_t number = 0, number8 = 0;
  absl::Status st = channel::BuildTapCall(*plan, slot_call, record.data(), &call, &number);
  const absl::Status st8 =
      channel::BuildTapCall(*plan8, slot_call8, record.data(), &call8, &number8);
  if (st.ok() != st8.ok()) return absl::InternalError("the two dtypes judge a record apart");
  if (!st.ok()) return st;
  const float scale8 = call8.kv_scale();
  if (!call8.has_kv_scale() || std::memcmp(&record[4 * tap::kTapRecordKvScale], &scale8, 4) != 0 ||
      call.has_kv_scale() ||
      call8.kv_pool().shm().byte_size() != call.kv_pool().shm().byte_size() / 2) {
    return absl::InternalError("an e4m3 tap call disagrees with its record");
  }
  // What was built stays inside the slot's ranges and agrees with itself.
  const int64_t batch = call.kv_lens().shape(0), pages = call.kv_indices().shape(0);
  const auto* indptr = reinterpret_cast<const int32_t*>(call.kv_indptr().raw_contents().data());
  const bool ok = batch >= 1 && batch <= 3 && pages >= 1 && pages <= 40 && indptr[0] == 0 &&
                  indptr[batch] == pages && call.q().shape(0) == batch * 4 &&
                  call.q().shm().byte_size() == uint64_t(Elements(call.q())) * 2 &&
                  call.q().shm().byte_size() <= slot_call.q().shm().byte_size() &&
                  call.o_out().shm().byte_size() == uint64_t(Elements(call.o_out())) * 2 &&
                  call.kv_pool().shm().byte_size() == uint64_t(pages) * 16 * 576 * 2 &&
                  call.kv_pool().shm().offset() == slot_call.kv_pool().shm().offset() &&
                  call.tree_mask().raw_contents().size() == size_t(batch) * 4 * 4;
  return ok ? absl::OkStatus() : absl::InternalError("a built tap call disagrees with its record");
}

absl::Status VmmFds(const uint8_t* data, size_t size) {
  if (size == 0) return absl::InvalidArgumentError("empty input");
  const size_t fds = data[0];
  const absl::string_view payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  constexpr uint32_t kMaxTotal = 8192;
  absl::StatusOr<VmmFdMessage> m = ParseVmmFdPayload(payload, fds, kMaxTotal);
  if (!m.ok()) return m.status();
  const bool ok = m->token.size() == kVmmTokenBytes && fds >= 1 && fds <= kVmmFdsPerMessage &&
                  m->total >= 1 && m->total <= kMaxTotal && m->first < m->total &&
                  fds <= m->total - m->first &&
                  VmmFdPayload(m->token, m->first, m->total) == payload;
  return ok ? absl::OkStatus() : absl::InternalError("an accepted message breaks its bounds");
}

const std::vector<Target>& Targets() {
  static const std::vector<Target> targets = {
      {"request", &Request}, {"safetensors", &Safetensors},    {"state", &State},
      {"audit", &Audit},     {"desired_state", &DesiredState}, {"rollout_plan", &RolloutPlan},
      {"channel", &Channel}, {"doorbell", &Doorbell},          {"vmm_fds", &VmmFds},
      {"tap", &Tap},
  };
  return targets;
}

}  // namespace verifyd::fuzz
