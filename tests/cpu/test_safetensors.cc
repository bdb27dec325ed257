// safetensors read/write: round trips, unaligned offsets, clear errors on corrupt files, a file
// numpy parses, and the bundle layout of the golden files.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/common/bf16.h"
#include "src/io/bundle_file.h"
#include "src/io/safetensors.h"

namespace verifyd {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("verifyd_st_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Tensors of every dtype the bundles use, with values a reader can recompute.
struct Sample {
  std::vector<uint16_t> bf16;  // k * 0.5 - 3, exact in bf16
  std::vector<float> f32;      // k * 0.25
  std::vector<int32_t> i32;    // k - 3
  std::vector<uint8_t> u8;     // k * 7 % 256
  std::vector<double> f64;     // k / 3.0
  std::vector<TensorRef> refs;

  Sample() {
    for (int k = 0; k < 2 * 3 * 5; ++k) bf16.push_back(FloatToBf16(k * 0.5f - 3));
    for (int k = 0; k < 7; ++k) f32.push_back(k * 0.25f);
    for (int k = 0; k < 4; ++k) i32.push_back(k - 3);
    for (int k = 0; k < 3; ++k) u8.push_back(static_cast<uint8_t>(k * 7));
    for (int k = 0; k < 2; ++k) f64.push_back(k / 3.0);
    // u8 first: the tensors after it start at odd offsets.
    refs = {{"u8", DType::kU8, {3}, u8.data()},    {"bf16", DType::kBF16, {2, 3, 5}, bf16.data()},
            {"f32", DType::kF32, {7}, f32.data()}, {"i32", DType::kI32, {2, 2}, i32.data()},
            {"f64", DType::kF64, {2}, f64.data()}, {"scalar_empty", DType::kF32, {0}, nullptr}};
  }
};

TEST_F(SafetensorsTest, RoundTripWithUnalignedOffsets) {
  Sample s;
  const std::map<std::string, std::string> meta = {{"case", "round trip"}, {"seed", "1"}};
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), s.refs, meta).ok());
  auto f = ReadSafetensors(Path("a.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata, meta);
  EXPECT_EQ(f->tensors.size(), 6u);
  const Tensor* bf16 = f->Find("bf16");
  ASSERT_NE(bf16, nullptr);
  EXPECT_EQ(bf16->dtype, DType::kBF16);
  EXPECT_EQ(bf16->shape, (std::vector<int64_t>{2, 3, 5}));
  EXPECT_EQ(std::vector<uint16_t>(bf16->as<uint16_t>(), bf16->as<uint16_t>() + 30), s.bf16);
  const Tensor* f32 = f->Find("f32");
  EXPECT_EQ(std::vector<float>(f32->as<float>(), f32->as<float>() + 7), s.f32);
  const Tensor* i32 = f->Find("i32");
  EXPECT_EQ(std::vector<int32_t>(i32->as<int32_t>(), i32->as<int32_t>() + 4), s.i32);
  EXPECT_EQ(f->Find("u8")->data, s.u8);
  const Tensor* f64 = f->Find("f64");
  EXPECT_EQ(std::vector<double>(f64->as<double>(), f64->as<double>() + 2), s.f64);
  EXPECT_EQ(f->Find("scalar_empty")->numel(), 0);
  EXPECT_EQ(f->Find("missing"), nullptr);

  // Writing the parsed file again gives the same bytes.
  ASSERT_TRUE(WriteSafetensors(Path("b.safetensors"), *f).ok());
  auto g = ReadSafetensors(Path("b.safetensors"));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->Find("f64")->data, f->Find("f64")->data);

  // The header is padded so that the data starts 8-byte aligned, and no temp file is left.
  const std::string bytes = ReadAll(Path("a.safetensors"));
  uint64_t header_len;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 2);
}

TEST_F(SafetensorsTest, OverwriteReplacesAtomically) {
  Sample s;
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"), s.refs, {}).ok());
  std::vector<TensorRef> one = {s.refs[2]};
  ASSERT_TRUE(WriteSafetensors(Path("x.safetensors"), one, {{"v", "2"}}).ok());
  auto f = ReadSafetensors(Path("x.safetensors"));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->tensors.size(), 1u);
  EXPECT_EQ(f->metadata.at("v"), "2");
}

TEST_F(SafetensorsTest, WriteErrors) {
  Sample s;
  EXPECT_EQ(WriteSafetensors(Path("no/such/dir/x.safetensors"), s.refs, {}).code(),
            absl::StatusCode::kNotFound);
  std::vector<TensorRef> dup = {s.refs[0], s.refs[0]};
  EXPECT_EQ(WriteSafetensors(Path("d.safetensors"), dup, {}).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<TensorRef> reserved = {{"__metadata__", DType::kU8, {3}, s.u8.data()}};
  EXPECT_EQ(SerializeSafetensors(reserved, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  auto f = ReadSafetensors(Path("absent.safetensors"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("absent.safetensors"), std::string::npos);
}

void ExpectDataLoss(const std::string& path, const std::string& needle) {
  auto f = ReadSafetensors(path);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << f.status();
  EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status();
  // The in-memory parser gives the same verdict.
  auto g = ParseSafetensors(ReadAll(path), path);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kDataLoss) << g.status();
}

TEST_F(SafetensorsTest, CorruptFilesGiveClearErrors) {
  Sample s;
  auto good = SerializeSafetensors(s.refs, {{"case", "x"}});
  ASSERT_TRUE(good.ok());
  uint64_t header_len;
  std::memcpy(&header_len, good->data(), 8);

  WriteAll(Path("short"), good->substr(0, 5));
  ExpectDataLoss(Path("short"), "shorter than the 8-byte header length");

  WriteAll(Path("header_cut"), good->substr(0, 8 + header_len / 2));
  ExpectDataLoss(Path("header_cut"), "header length");

  // The last tensor (in header order, f64 ends the data) loses its bytes.
  WriteAll(Path("data_cut"), good->substr(0, good->size() - 3));
  ExpectDataLoss(Path("data_cut"), "truncated");

  std::string bad_json = *good;
  bad_json[8] = 'x';
  WriteAll(Path("bad_json"), bad_json);
  ExpectDataLoss(Path("bad_json"), "not valid JSON");

  const std::string header = R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  std::string wrong_size(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(wrong_size.data(), &n, 8);
  wrong_size += header + std::string(8, '\0');
  WriteAll(Path("wrong_size"), wrong_size);
  ExpectDataLoss(Path("wrong_size"), "tensor 't' holds 8 bytes but F32 [3] needs 12");

  const std::string header2 = R"({"t":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})";
  std::string bad_dtype(8, '\0');
  const uint64_t n2 = header2.size();
  std::memcpy(bad_dtype.data(), &n2, 8);
  bad_dtype += header2 + "x";
  WriteAll(Path("bad_dtype"), bad_dtype);
  ExpectDataLoss(Path("bad_dtype"), "unsupported dtype \"Q7\"");

  // 2^61 F64 elements would wrap a 64-bit byte count to 0.
  const std::string header3 =
      R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}})";
  std::string huge(8, '\0');
  const uint64_t n3 = header3.size();
  std::memcpy(huge.data(), &n3, 8);
  huge += header3;
  WriteAll(Path("huge"), huge);
  ExpectDataLoss(Path("huge"), "bad shape");
}

TEST_F(SafetensorsTest, EveryTruncationAndHeaderByteFlipIsHandled) {
  Sample s;
  auto good = SerializeSafetensors(s.refs, {{"case", "x"}});
  ASSERT_TRUE(good.ok());
  uint64_t header_len;
  std::memcpy(&header_len, good->data(), 8);
  for (size_t len = 0; len < good->size(); ++len) {
    auto f = ParseSafetensors(std::string_view(*good).substr(0, len), "cut");
    ASSERT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << "length " << len;
  }
  for (size_t pos = 0; pos < 8 + header_len; ++pos) {
    for (char c : {'\0', '"', '9', '}', '\xff'}) {
      std::string bytes = *good;
      bytes[pos] = c;
      auto f = ParseSafetensors(bytes, "flip");
      ASSERT_TRUE(f.ok() || f.status().code() == absl::StatusCode::kDataLoss) << f.status();
    }
  }
}

// python3 with numpy, or "" when there is none.
std::string PythonWithNumpy() {
  for (const char* py : {"/usr/bin/python3", "python3"}) {
    const std::string cmd = std::string(py) + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

TEST_F(SafetensorsTest, NumpyReadsWhatWeWrite) {
  const std::string py = PythonWithNumpy();
  if (py.empty()) GTEST_SKIP() << "python3 with numpy not found";
  Sample s;
  ASSERT_TRUE(WriteSafetensors(Path("py.safetensors"), s.refs, {{"case", "numpy"}}).ok());
  const std::string script = R"PY(
import json, struct, sys
import numpy as np
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
h = json.loads(raw[8:8 + n])
data = raw[8 + n:]
assert h["__metadata__"] == {"case": "numpy"}, h["__metadata__"]
def get(name, dt):
    e = h[name]
    b, end = e["data_offsets"]
    return np.frombuffer(data[b:end], dtype=dt).reshape(e["shape"])
bf = get("bf16", "<u2").astype(np.uint32) << 16
assert h["bf16"]["dtype"] == "BF16" and h["bf16"]["shape"] == [2, 3, 5]
assert np.array_equal(bf.view(np.float32).ravel(), np.arange(30, dtype=np.float32) * 0.5 - 3)
assert np.array_equal(get("f32", "<f4"), np.arange(7, dtype=np.float32) * 0.25)
assert np.array_equal(get("i32", "<i4").ravel(), np.arange(4) - 3)
assert np.array_equal(get("u8", "u1"), np.arange(3) * 7)
assert np.array_equal(get("f64", "<f8"), np.arange(2) / 3.0)
assert get("scalar_empty", "<f4").size == 0
print("numpy ok")
)PY";
  WriteAll(Path("check.py"), script);
  const std::string cmd = py + " " + Path("check.py") + " " + Path("py.safetensors");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST_F(SafetensorsTest, BundleFileRoundTrip) {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 11;
  spec.heads = 3;
  spec.page_size = 4;
  spec.prefix_lens = {0, 9};
  spec.mask_format = kernels::MaskFormat::kBits;
  spec.seed = 77;
  RandomBundle rb(spec);
  const BundleView& v = rb.view();
  std::vector<uint16_t> o_custom(v.o_elems(), FloatToBf16(1.5f));
  ASSERT_TRUE(SaveBundleFile(Path("bundle.safetensors"), v,
                             {{"o_custom", DType::kBF16, {v.rows(), 3, 512}, o_custom.data()}},
                             {{"reason", "breach"}})
                  .ok());
  auto bf = LoadBundleFile(Path("bundle.safetensors"));
  ASSERT_TRUE(bf.ok()) << bf.status();
  const BundleView& w = bf->view;
  EXPECT_EQ(w.shape.batch, 2);
  EXPECT_EQ(w.shape.draft, 11);
  EXPECT_EQ(w.shape.heads, 3);
  EXPECT_EQ(w.shape.page_size, 4);
  EXPECT_EQ(w.shape.num_pages, v.shape.num_pages);
  EXPECT_EQ(w.shape.num_indices, v.shape.num_indices);
  EXPECT_EQ(w.shape.mask_format, kernels::MaskFormat::kBytes);  // saved unpacked
  EXPECT_EQ(w.sm_scale, v.sm_scale);
  EXPECT_TRUE(std::equal(v.q, v.q + v.q_elems(), w.q));
  // NaN bit patterns survive byte for byte.
  EXPECT_EQ(std::memcmp(v.kv_pool, w.kv_pool, v.kv_bytes()), 0);
  EXPECT_TRUE(std::equal(v.kv_indptr, v.kv_indptr + 3, w.kv_indptr));
  EXPECT_TRUE(std::equal(v.kv_indices, v.kv_indices + v.shape.num_indices, w.kv_indices));
  EXPECT_TRUE(std::equal(v.kv_lens, v.kv_lens + 2, w.kv_lens));
  for (int b = 0; b < 2; ++b) {
    for (int i = 0; i < 11; ++i) {
      for (int j = 0; j < 11; ++j) ASSERT_EQ(v.MaskBit(b, i, j), w.MaskBit(b, i, j));
    }
  }
  EXPECT_EQ(bf->o_expected, nullptr);
  ASSERT_NE(bf->Find("o_custom"), nullptr);
  EXPECT_EQ(bf->Find("o_custom")->as<uint16_t>()[5], FloatToBf16(1.5f));
  EXPECT_EQ(bf->metadata().at("reason"), "breach");
  EXPECT_EQ(bf->metadata().at("T"), "11");
  EXPECT_EQ(bf->metadata().at("mask_format_received"), "bits");

  // A copy shares the tensors; the view stays valid after the original goes.
  BundleFile copy = *bf;
  bf = absl::UnknownError("gone");
  EXPECT_EQ(copy.view.q[0], v.q[0]);
}

// A capture of an fp8 call keeps its pool's e4m3 bytes (dtype F8_E4M3) and its scale.
TEST_F(SafetensorsTest, BundleFileRoundTripOfAnE4m3Pool) {
  RandomBundleSpec spec;
  spec.batch = 2;
  spec.draft = 5;
  spec.heads = 2;
  spec.page_size = 16;
  spec.prefix_lens = {21, 3};
  spec.seed = 78;
  RandomBundle rb(spec);
  BundleView v = rb.view();
  std::vector<uint8_t> e4m3(rb.kv_pool.size());
  for (size_t i = 0; i < e4m3.size(); ++i) e4m3[i] = static_cast<uint8_t>(i * 37 % 255);
  v.kv_pool = e4m3.data();
  v.shape.kv_dtype = kernels::KvDtype::kE4m3;
  v.kv_scale = 0.375f;
  ASSERT_TRUE(SaveBundleFile(Path("fp8.safetensors"), v).ok());
  auto raw = ReadSafetensors(Path("fp8.safetensors"));
  ASSERT_TRUE(raw.ok()) << raw.status();
  ASSERT_NE(raw->Find("kv_pool"), nullptr);
  EXPECT_EQ(raw->Find("kv_pool")->dtype, DType::kF8E4M3);
  auto bf = LoadBundleFile(Path("fp8.safetensors"));
  ASSERT_TRUE(bf.ok()) << bf.status();
  const BundleView& w = bf->view;
  EXPECT_EQ(w.shape.kv_dtype, kernels::KvDtype::kE4m3);
  EXPECT_EQ(w.kv_scale, 0.375f);
  EXPECT_EQ(std::memcmp(w.kv_pool, e4m3.data(), e4m3.size()), 0);
  // A bf16 bundle's file has no kv_scale and reads back at 1.
  ASSERT_TRUE(SaveBundleFile(Path("bf16.safetensors"), rb.view()).ok());
  auto plain = ReadSafetensors(Path("bf16.safetensors"));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->Find("kv_scale"), nullptr);
}

TEST_F(SafetensorsTest, BundleFileLayoutErrorsNameTheTensor) {
  RandomBundleSpec spec;
  spec.draft = 3;
  spec.heads = 2;
  spec.seed = 78;
  RandomBundle rb(spec);
  ASSERT_TRUE(SaveBundleFile(Path("ok.safetensors"), rb.view()).ok());
  auto file = ReadSafetensors(Path("ok.safetensors"));
  ASSERT_TRUE(file.ok());

  SafetensorsFile f = *file;
  f.tensors["q"].dtype = DType::kF16;
  auto r = BundleFileFromSafetensors(f, "case");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "case: q: dtype F16, expected BF16");

  f = *file;
  f.tensors.erase("kv_lens");
  r = BundleFileFromSafetensors(f, "case");
  EXPECT_EQ(r.status().message(), "case: tensor 'kv_lens' is missing");

  f = *file;
  f.tensors["tree_mask"].shape = {1, 3, 2};
  r = BundleFileFromSafetensors(f, "case");
  EXPECT_EQ(r.status().message(), "case: tree_mask: shape [1, 3, 2], expected [1, 3, 3]");

  f = *file;
  f.tensors["o_expected"] = Tensor{DType::kF32, {3, 2, 511}, std::vector<uint8_t>(3 * 2 * 511 * 4)};
  r = BundleFileFromSafetensors(f, "case");
  EXPECT_EQ(r.status().message(), "case: o_expected: shape [3, 2, 511], expected [3, 2, 512]");
}

}  // namespace
}  // namespace verifyd
