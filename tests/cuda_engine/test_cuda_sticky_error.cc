// CUDA errors as statuses, and a lost context (illegal address or trap) reported as DATA_LOSS by
// every later engine call. Its own binary: the context cannot be used again once lost.

#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "src/bundle/random_bundle.h"
#include "src/cuda_engine/cuda_engine.h"
#include "src/cuda_engine/cuda_status.h"
#include "tests/common/gpu_test_support.h"
#include "tests/cuda_engine/illegal_address_kernel.h"

namespace verifyd {
namespace {

TEST(CudaStatus, StickyErrorsAreKnown) {
  EXPECT_TRUE(IsStickyCudaError(cudaErrorIllegalAddress));
  EXPECT_TRUE(IsStickyCudaError(cudaErrorLaunchFailure));
  EXPECT_FALSE(IsStickyCudaError(cudaErrorInvalidValue));
  EXPECT_FALSE(IsStickyCudaError(cudaErrorMemoryAllocation));
}

TEST(CudaStatus, OrdinaryErrorIsInternalAndNamed) {
  VERIFYD_SKIP_WITHOUT_GPU();
  bool sticky = true;
  const absl::Status st = CudaStatus(cudaErrorInvalidValue, "custom path", 0, &sticky);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(sticky);
  EXPECT_NE(st.message().find("cudaErrorInvalidValue"), std::string::npos) << st;
  EXPECT_NE(st.message().find("custom path"), std::string::npos) << st;
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "x", 0).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x", 0).ok());
}

// Must stay the last test of this binary: afterwards the process has no usable context.
TEST(StickyError, LostContextIsDataLossOnEveryLaterCall) {
  VERIFYD_SKIP_WITHOUT_GPU();
  absl::Status made;
  CudaEngineOptions options;
  options.devices = {0};
  auto engine = MakeCudaEngine(options, &made);
  ASSERT_NE(engine, nullptr) << made;
  // The engine reports the lost device itself, once, to whoever serves with it.
  std::atomic<int> lost_reports{0};
  engine->SetDeviceLostHandler([&](const absl::Status& st) {
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    ++lost_reports;
  });
  RandomBundleSpec s;
  s.batch = 2;
  s.draft = 4;
  s.heads = 8;
  s.page_size = 16;
  s.prefix = 40;
  s.seed = 3;
  RandomBundle rb(s);
  auto pb = engine->Prepare(rb.view(), false);
  ASSERT_TRUE(pb.ok()) << pb.status();
  ASSERT_TRUE(engine->Run(Path::kReference, **pb).ok());
  PathOutput ref;
  ASSERT_TRUE(engine->Fetch(Path::kReference, **pb, &ref).ok());

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const cudaError_t e = testing_kernels::LoseContext(stream);
  ASSERT_NE(e, cudaSuccess);
  std::printf("context lost with %s\n", cudaGetErrorName(e));

  const absl::Status custom = engine->Run(Path::kCustom, **pb);
  std::printf("custom run after the lost context: %s\n", custom.ToString().c_str());
  EXPECT_EQ(custom.code(), absl::StatusCode::kDataLoss) << custom;
  EXPECT_NE(custom.message().find("sticky CUDA error"), std::string::npos) << custom;
  EXPECT_NE(custom.message().find(cudaGetErrorName(e)), std::string::npos) << custom;
  // Every later call says the same, without touching the lost context again.
  EXPECT_EQ(engine->Fetch(Path::kReference, **pb, &ref).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(engine->Run(Path::kReference, **pb).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(engine->Prepare(rb.view(), false).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(lost_reports.load(), 1);
}

}  // namespace
}  // namespace verifyd
