#include "src/capture/capturer.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "src/io/bundle_file.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// SaveBundleFile writes NAME.safetensors.tmp.XXXXXX and renames it when complete.
bool IsTempFile(const std::string& name) {
  return name.find(".safetensors.tmp.") != std::string::npos;
}

// %.17g: reading the number back gives the same double, so replay can check it exactly.
std::string Exact(double v) { return absl::StrFormat("%.17g", v); }

}  // namespace

absl::StatusOr<std::unique_ptr<Capturer>> Capturer::Create(const CaptureOptions& opts,
                                                           std::string build_info) {
  std::error_code ec;
  fs::create_directories(opts.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("capture_dir ", opts.dir, ": ", ec.message()));
  std::unique_ptr<Capturer> c(new Capturer(opts, std::move(build_info)));
  std::vector<std::pair<fs::file_time_type, File>> found;
  for (const auto& e : fs::directory_iterator(opts.dir, ec)) {
    if (!e.is_regular_file()) continue;
    if (IsTempFile(e.path().filename().string())) {  // a write cut short by a crash
      std::error_code rm;
      fs::remove(e.path(), rm);
      if (rm) {
        spdlog::warn("capture: cannot remove the unfinished {}: {}", e.path().string(),
                     rm.message());
      } else {
        spdlog::info("capture: removed the unfinished {}", e.path().string());
      }
      continue;
    }
    if (e.path().extension() != ".safetensors") continue;
    found.push_back(
        {e.last_write_time(), {e.path().string(), static_cast<int64_t>(e.file_size())}});
  }
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first < b.first; });
  absl::MutexLock l(&c->mu_);
  for (auto& [t, f] : found) {
    c->bytes_ += f.bytes;
    c->files_.push_back(std::move(f));
  }
  c->EnforceQuotaLocked();
  return c;
}

Capturer::Capturer(CaptureOptions opts, std::string build_info)
    : opts_(std::move(opts)), build_info_(std::move(build_info)) {}

std::string Capturer::Claim(bool breach) {
  absl::MutexLock l(&mu_);
  if (pending_ > 0) {
    --pending_;
    return "requested";
  }
  if (!breach) return "";
  const double now = NowSeconds();
  if (now - last_breach_capture_ < opts_.min_breach_interval_seconds) {
    ++dropped_;
    return "";
  }
  last_breach_capture_ = now;
  return "breach";
}

absl::Status Capturer::Dropped(const std::string& trigger, absl::Status why) {
  absl::MutexLock l(&mu_);
  return DroppedLocked(trigger, std::move(why));
}

absl::Status Capturer::DroppedLocked(const std::string& trigger, absl::Status why) {
  ++dropped_;
  if (trigger == "requested") ++pending_;  // a requested capture not written keeps its slot
  return why;
}

void Capturer::RequestNext(int64_t n) {
  absl::MutexLock l(&mu_);
  pending_ = std::max<int64_t>(0, n);
}

CaptureStatus Capturer::Status() const {
  absl::MutexLock l(&mu_);
  return {opts_.dir, static_cast<int64_t>(files_.size()), bytes_, pending_, written_, dropped_};
}

void Capturer::EnforceQuotaLocked() {
  // Files being written count too: their temporary files are on the disk already.
  while (!files_.empty() &&
         (bytes_ + writing_bytes_ > opts_.max_bytes ||
          static_cast<int64_t>(files_.size()) + writing_files_ > opts_.max_files)) {
    std::error_code ec;
    fs::remove(files_.front().path, ec);
    bytes_ -= files_.front().bytes;
    files_.pop_front();
  }
}

absl::StatusOr<std::string> Capturer::Write(const ComparisonRecord& r, const std::string& trigger) {
  if (!r.bundle) return absl::FailedPreconditionError("capture: no bundle inputs");
  const BundleView& v = r.bundle->view();
  const int64_t o = v.o_elems(), lse = v.lse_elems();
  const std::vector<int64_t> o_shape = {v.rows(), v.shape.heads, kernels::kHeadDimV};
  const std::vector<int64_t> lse_shape = {v.rows(), v.shape.heads};
  std::vector<TensorRef> extra;
  int64_t extra_bytes = 0;
  auto add = [&](const char* name, DType dtype, const std::vector<int64_t>& shape, const void* data,
                 int64_t bytes) {
    if (data && bytes > 0) {
      extra.push_back({name, dtype, shape, data});
      extra_bytes += bytes;
    }
  };
  add("o_reference", DType::kBF16, o_shape, r.reference.o.data(),
      r.reference.o.size() == static_cast<size_t>(o) ? o * 2 : 0);
  add("o_custom", DType::kBF16, o_shape, r.custom.o.data(),
      r.custom.o.size() == static_cast<size_t>(o) ? o * 2 : 0);
  add("lse_reference", DType::kF32, lse_shape, r.reference.lse.data(),
      r.reference.lse.size() == static_cast<size_t>(lse) ? lse * 4 : 0);
  add("lse_custom", DType::kF32, lse_shape, r.custom.lse.data(),
      r.custom.lse.size() == static_cast<size_t>(lse) ? lse * 4 : 0);
  if (r.has_oracle) {
    add("o_oracle", DType::kF32, o_shape, r.oracle.o_f32.data(),
        r.oracle.o_f32.size() == static_cast<size_t>(o) ? o * 4 : 0);
  }
  add("o_stack", DType::kBF16, o_shape, r.stack_o.data(),
      r.stack_o.size() == static_cast<size_t>(o) ? o * 2 : 0);
  std::map<std::string, std::string> meta = {
      {"case", "capture"},
      {"trigger", trigger},
      {"time", absl::FormatTime(absl::RFC3339_full, absl::Now(), absl::UTCTimeZone())},
      {"mode", ModeName(r.plan.mode)},
      {"served", PathName(r.plan.served)},
      {"outcome", OutcomeName(r.outcome.kind)},
      {"reason", r.outcome.reason},
      {"request_id", r.request_id},
      {"build", build_info_},
      {"B", std::to_string(v.shape.batch)},
      {"T", std::to_string(v.shape.draft)},
      {"H", std::to_string(v.shape.heads)},
      {"page_size", std::to_string(v.shape.page_size)},
      {"tol_atol", Exact(r.tolerance.atol)},
      {"tol_rtol", Exact(r.tolerance.rtol)},
      {"tol_max_rel_l2", Exact(r.tolerance.max_rel_l2)},
      {"tol_max_abs", Exact(r.tolerance.max_abs)},
      {"tol_max_lse_abs", Exact(r.tolerance.max_lse_abs)},
      {"tol_max_beyond_tol", std::to_string(r.tolerance.max_beyond_tol)},
      {"tol_atol_rel", Exact(r.tolerance.atol_rel)},
      {"tol_max_row_rel_l2", Exact(r.tolerance.max_row_rel_l2)},
  };
  if (!r.stack_backend.empty()) meta["stack_backend"] = r.stack_backend;
  if (r.outcome.stats) {
    const DiffStats& d = *r.outcome.stats;
    meta["rel_l2"] = Exact(d.rel_l2);
    meta["max_abs"] = Exact(d.max_abs);
    meta["nmse"] = Exact(d.nmse);
    meta["beyond_tol"] = std::to_string(d.beyond_tol);
    meta["lse_max_abs"] = Exact(d.lse_max_abs);
    meta["max_row_rel_l2"] = Exact(d.max_row_rel_l2);
    meta["worst_row"] = std::to_string(d.worst_row);
    meta["zero_row_breaches"] = std::to_string(d.zero_row_breaches);
  }
  // Size estimate: inputs + extras; refuse rather than fill the disk.
  int64_t need = v.q_elems() * 2 + v.kv_bytes() + v.mask_bytes() + (v.shape.batch * 3 + 1) * 4;
  need += extra_bytes;
  struct statvfs sv;
  if (::statvfs(opts_.dir.c_str(), &sv) == 0) {
    const int64_t free_bytes = static_cast<int64_t>(sv.f_bavail) * sv.f_frsize;
    if (free_bytes - need < opts_.min_free_bytes) {
      return Dropped(trigger, absl::ResourceExhaustedError(absl::StrCat(
                                  "capture: ", free_bytes, " bytes free on ", opts_.dir,
                                  "; keeping ", opts_.min_free_bytes, " free")));
    }
  }
  if (need > opts_.max_bytes) {
    return Dropped(trigger,
                   absl::ResourceExhaustedError(absl::StrCat(
                       "capture: bundle of ", need, " bytes exceeds the quota ", opts_.max_bytes)));
  }
  std::string path;
  {
    absl::MutexLock l(&mu_);
    // Names sort in write order: UTC time, then a zero-padded sequence number.
    path = absl::StrFormat("%s/%s-%06d-%s.safetensors", opts_.dir,
                           absl::FormatTime("%Y%m%dT%H%M%S", absl::Now(), absl::UTCTimeZone()),
                           ++seq_, trigger);
    writing_bytes_ += need;
    ++writing_files_;
    EnforceQuotaLocked();  // make room before the temporary file takes it
  }
  const absl::Status saved = SaveBundleFile(path, v, extra, meta);
  std::error_code ec;
  const int64_t size = saved.ok() ? static_cast<int64_t>(fs::file_size(path, ec)) : 0;
  absl::MutexLock l(&mu_);
  writing_bytes_ -= need;
  --writing_files_;
  if (!saved.ok()) return DroppedLocked(trigger, saved);
  ++written_;
  files_.push_back({path, ec ? need : size});
  bytes_ += files_.back().bytes;
  EnforceQuotaLocked();
  return path;
}

}  // namespace verifyd
