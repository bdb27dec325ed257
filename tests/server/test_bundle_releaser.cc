// The bundle releaser drops bundles on its own thread, never one another holder still has, and
// drops every queued bundle before its destructor returns.

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "src/server/bundle_releaser.h"

namespace verifyd {
namespace {

// Records where and whether it was destroyed.
class TracedBundle : public PreparedBundle {
 public:
  TracedBundle(std::atomic<int>* destroyed, std::thread::id* where)
      : PreparedBundle(kernels::ProblemShape{}), destroyed_(destroyed), where_(where) {}
  ~TracedBundle() override {
    if (where_ != nullptr) *where_ = std::this_thread::get_id();
    destroyed_->fetch_add(1);
  }

 private:
  std::atomic<int>* destroyed_;
  std::thread::id* where_;
};

TEST(BundleReleaser, DropsABundleOnItsOwnThread) {
  std::atomic<int> destroyed{0};
  std::thread::id where;
  BundleReleaser releaser;
  releaser.Release(std::make_shared<TracedBundle>(&destroyed, &where));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (destroyed.load() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(destroyed.load(), 1);
  EXPECT_NE(where, std::this_thread::get_id());
}

TEST(BundleReleaser, ABundleHeldElsewhereOutlivesTheRelease) {
  std::atomic<int> destroyed{0};
  std::shared_ptr<PreparedBundle> kept;
  {
    BundleReleaser releaser;
    auto b = std::make_shared<TracedBundle>(&destroyed, nullptr);
    kept = b;  // a deferred comparison's reference
    releaser.Release(std::move(b));
  }  // the releaser has dropped its reference
  EXPECT_EQ(destroyed.load(), 0);
  kept.reset();
  EXPECT_EQ(destroyed.load(), 1);
}

TEST(BundleReleaser, EveryQueuedBundleIsDroppedBeforeTheDestructorReturns) {
  std::atomic<int> destroyed{0};
  constexpr int kBundles = 1000;
  {
    BundleReleaser releaser;
    for (int i = 0; i < kBundles; ++i) {
      releaser.Release(std::make_shared<TracedBundle>(&destroyed, nullptr));
    }
  }
  EXPECT_EQ(destroyed.load(), kBundles);
}

}  // namespace
}  // namespace verifyd
