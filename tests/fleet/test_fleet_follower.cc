// The follower on real files with real inotify: a ConfigMap's update as the kubelet makes it (a
// new directory, then the ..data symlink swapped), a file caught half written, a missing file,
// a state for another build, and each generation acted on once.

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "src/fleet/fleet_follower.h"
#include "tests/fleet/fleet_proposals.h"

namespace verifyd::fleet {
namespace {

namespace fs = std::filesystem;

// A ConfigMap volume: DIR/fleet.json -> ..data/fleet.json, ..data -> ..<version>/.
class ConfigMapDir {
 public:
  ConfigMapDir() {
    char tmpl[] = "/tmp/verifyd-fleet-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  ~ConfigMapDir() { fs::remove_all(dir_); }
  std::string file() const { return dir_ + "/fleet.json"; }
  // What the kubelet does: the new version in a directory of its own, a temporary symlink to
  // it renamed over ..data (atomic), then the key's symlink if it is new.
  void Publish(const std::string& text) {
    const std::string version = absl::StrCat("..2026_12_06_", ++versions_);
    fs::create_directory(dir_ + "/" + version);
    std::ofstream(dir_ + "/" + version + "/fleet.json") << text;
    fs::create_directory_symlink(version, dir_ + "/..data_tmp");
    fs::rename(dir_ + "/..data_tmp", dir_ + "/..data");
    if (!fs::is_symlink(file())) fs::create_symlink("..data/fleet.json", file());
  }
  // Not what the kubelet does: the file written in place, in two pieces.
  void WriteInPlace(const std::string& text) {
    fs::remove(file());
    std::ofstream(file()) << text;
  }
  void Remove() { fs::remove(file()); }

 private:
  std::string dir_;
  int versions_ = 0;
};

template <typename F>
bool WaitFor(F done, double seconds = 10) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

FollowerOptions Options(const ConfigMapDir& d, const std::string& node = "node-a") {
  FollowerOptions o;
  o.path = d.file();
  o.node = node;
  o.build = "0123456789ab";
  o.poll = absl::Seconds(30);  // the events alone must wake it
  return o;
}

TEST(FleetFollower, AKubeletSwapIsSeenAtOnceAndEachGenerationIsProposedOnce) {
  ConfigMapDir d;
  d.Publish(R"({"generation": 1, "mode": "shadow"})");
  Proposals p;
  p.takes = absl::Milliseconds(100);
  FleetFollower f(Options(d), p.fn());
  ASSERT_TRUE(f.Start().ok());
  EXPECT_EQ(p.count(), 1u);  // the first look is made before Start returns
  EXPECT_EQ(p.last(), "shadow 0 | fleet generation 1 (in its step)");
  EXPECT_TRUE(f.status().source_up);

  const auto t0 = std::chrono::steady_clock::now();
  d.Publish(R"({"generation": 2, "mode": "canary", "canary_fraction": 0.25, "reason": "r1"})");
  ASSERT_TRUE(WaitFor([&] { return p.count() == 2; }));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 2.0) << "the swap was not seen by its events";
  EXPECT_EQ(p.last(), "canary 0.25 | fleet generation 2 (in its step): r1");
  // Acted once the proposal returns.
  EXPECT_TRUE(WaitFor([&] { return f.status().generation_acted == 2; }))
      << f.status().generation_acted;
  EXPECT_EQ(f.status().last_outcome, "applied");

  // The same generation again (another write of the same state, a look by the poll) proposes
  // nothing: a node whose own gate rolled it back stays rolled back.
  d.Publish(R"({"generation": 2, "mode": "canary", "canary_fraction": 0.25, "reason": "r1"})");
  f.LookNow();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(p.count(), 2u);
  // An older generation proposes nothing either.
  d.Publish(R"({"generation": 1, "mode": "custom"})");
  f.LookNow();
  EXPECT_EQ(p.count(), 2u);
  EXPECT_EQ(f.status().generation_seen, 2);
}

TEST(FleetFollower, ATornFileIsRefusedAndTheNodeKeepsItsModeUntilAValidOneComes) {
  ConfigMapDir d;
  d.Publish(R"({"generation": 1, "mode": "custom"})");
  Proposals p;
  FleetFollower f(Options(d), p.fn());
  ASSERT_TRUE(f.Start().ok());
  ASSERT_EQ(p.count(), 1u);
  d.WriteInPlace(R"({"generation": 2, "mode": "ref)");  // a writer caught half way
  ASSERT_TRUE(WaitFor([&] { return !f.status().source_up; }));
  EXPECT_EQ(f.status().source_error.find("desired state: not JSON"), 0u) << f.status().source_error;
  EXPECT_EQ(p.count(), 1u);
  d.WriteInPlace(R"({"generation": 2, "mode": "reference"})");
  ASSERT_TRUE(WaitFor([&] { return p.count() == 2; }));
  EXPECT_TRUE(f.status().source_up);
  EXPECT_EQ(p.last(), "reference 0 | fleet generation 2 (in its step)");
}

// The node's mode changes only after observe has seen the source up again: a look at the mode
// and then at the source never finds the new mode beside a source still down.
TEST(FleetFollower, ASourceBackUpIsObservedBeforeTheModeItAsksForIsProposed) {
  ConfigMapDir d;
  bool observed_up = false;
  std::vector<bool> up_when_proposed;
  FleetFollower f(
      Options(d),
      [&](const NodeTarget&, const std::string&) {
        up_when_proposed.push_back(observed_up);
        return absl::OkStatus();
      },
      [&](const FollowerStatus& s, bool) { observed_up = s.source_up; });
  f.Consider(absl::UnavailableError("gone"));
  ASSERT_FALSE(observed_up);
  f.Consider(std::string(R"({"generation": 1, "mode": "custom"})"));
  EXPECT_EQ(up_when_proposed, std::vector<bool>{true});
  EXPECT_TRUE(observed_up);
}

TEST(FleetFollower, AMissingFileIsASourceDownAndNothingIsProposed) {
  ConfigMapDir d;
  Proposals p;
  FleetFollower f(Options(d), p.fn());
  ASSERT_TRUE(f.Start().ok());
  EXPECT_FALSE(f.status().source_up);
  EXPECT_NE(f.status().source_error.find("cannot read"), std::string::npos);
  d.Publish(R"({"generation": 4, "mode": "shadow"})");
  ASSERT_TRUE(WaitFor([&] { return p.count() == 1; }));
  d.Remove();
  ASSERT_TRUE(WaitFor([&] { return !f.status().source_up; }));
  EXPECT_EQ(f.status().generation_acted, 4);
  EXPECT_EQ(p.count(), 1u);

  // A directory that does not exist yet (a ConfigMap not mounted) is a source down, not a
  // failure to start; once it appears it is watched.
  const std::string later = d.file() + ".d";
  FollowerOptions nowhere = Options(d);
  nowhere.path = later + "/fleet.json";
  nowhere.poll = absl::Milliseconds(50);
  Proposals q;
  FleetFollower g(nowhere, q.fn());
  ASSERT_TRUE(g.Start().ok());
  EXPECT_FALSE(g.status().source_up);
  EXPECT_NE(g.status().source_error.find("cannot watch the directory " + later), std::string::npos)
      << g.status().source_error;
  std::filesystem::create_directory(later);
  std::ofstream(later + "/fleet.json") << R"({"generation": 1, "mode": "shadow"})";
  ASSERT_TRUE(WaitFor([&] { return q.count() == 1; }));
  EXPECT_TRUE(g.status().source_up);
  std::filesystem::remove_all(later);
}

TEST(FleetFollower, AStateForAnotherBuildIsRefusedAndARefusalIsReported) {
  ConfigMapDir d;
  d.Publish(R"({"generation": 1, "mode": "custom", "build": "fedcba987654"})");
  Proposals p;
  FleetFollower f(Options(d), p.fn());
  ASSERT_TRUE(f.Start().ok());
  EXPECT_EQ(p.count(), 0u);
  EXPECT_EQ(f.status().last_outcome, "other_build");
  EXPECT_NE(f.status().last_detail.find("this node runs 0123456789ab"), std::string::npos);

  {
    absl::MutexLock l(&p.mu);
    p.answer = absl::FailedPreconditionError("gate closed: 0 of 200 clean comparisons");
  }
  d.Publish(R"({"generation": 2, "mode": "custom", "build": "0123456789ab"})");
  ASSERT_TRUE(WaitFor([&] { return f.status().generation_acted == 2; }));
  EXPECT_EQ(f.status().last_outcome, "refused");
  EXPECT_EQ(f.status().last_detail, "custom refused: gate closed: 0 of 200 clean comparisons");
}

TEST(FleetFollower, ANodeOutsideTheStepIsAskedForTheStableMode) {
  ConfigMapDir d;
  d.Publish(R"({"generation": 1, "mode": "custom", "step": {"nodes": ["node-b"]}})");
  Proposals a, b;
  FleetFollower fa(Options(d, "node-a"), a.fn()), fb(Options(d, "node-b"), b.fn());
  ASSERT_TRUE(fa.Start().ok());
  ASSERT_TRUE(fb.Start().ok());
  EXPECT_EQ(a.last(), "shadow 0 | fleet generation 1 (stable)");
  EXPECT_FALSE(fa.status().in_step);
  EXPECT_EQ(b.last(), "custom 0 | fleet generation 1 (in its step)");
  EXPECT_TRUE(fb.status().in_step);
}

}  // namespace
}  // namespace verifyd::fleet
