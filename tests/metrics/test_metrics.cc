// The metrics exposition as Prometheus scrapes it, over real HTTP: histogram `le` labels are
// exact decimals with the default tolerances among them and ten edges per decade where the
// diffs sit, the series dashboards need exist at 0 from the start, and /healthz and /readyz
// answer for probes (also on the in-process daemon).

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"
#include "src/compare/compare.h"
#include "src/metrics/buckets.h"
#include "src/metrics/metrics.h"
#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

std::unique_ptr<MetricsServer> StartServer(const Metrics& m, std::function<bool()> ready = {}) {
  auto s = MetricsServer::Start("127.0.0.1:0", m.registry(), std::move(ready));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

httplib::Result Get(int port, const std::string& path) {
  httplib::Client cli("127.0.0.1", port);
  return cli.Get(path);
}

// The `le` labels of one histogram series, in exposition order, without "+Inf".
std::vector<std::string> LeLabels(const std::string& text, const std::string& bucket_series,
                                  const std::string& other_label) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind(bucket_series + "{", 0) != 0) continue;
    const size_t open = bucket_series.size() + 1, close = l.find('}', open);
    if (close == std::string::npos) continue;
    const std::string labels = l.substr(open, close - open);
    if (!other_label.empty() && labels.find(other_label) == std::string::npos) continue;
    const size_t at = labels.find("le=\"");
    if (at == std::string::npos) continue;
    const size_t from = at + 4, to = labels.find('"', from);
    const std::string le = labels.substr(from, to - from);
    if (to != std::string::npos && le != "+Inf") out.push_back(le);
  }
  return out;
}

std::string Scrape(const Metrics& m) {
  auto server = StartServer(m);
  if (!server) return "";
  auto res = Get(server->port(), "/metrics");
  EXPECT_TRUE(res && res->status == 200);
  return res ? res->body : "";
}

BuildInfo TestBuild() { return {"0.0.0", "test", "cpu", "cpu", "", ""}; }

// The short decimal a label must be: it parses to a value that prints back the same with at
// most three significant digits.
bool ShortDecimal(const std::string& le) {
  char* end = nullptr;
  const double v = std::strtod(le.c_str(), &end);
  if (*end != '\0' || !(v > 0)) return false;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return le == buf;
}

int EdgesIn(const std::vector<std::string>& les, double lo, double hi) {
  int n = 0;
  for (const std::string& s : les) {
    const double v = std::strtod(s.c_str(), nullptr);
    if (v >= lo * (1 - 1e-12) && v < hi * (1 - 1e-12)) ++n;
  }
  return n;
}

TEST(MetricsExposition, DiffBucketsAreExactDecimalsWithTheTolerancesAsEdges) {
  Metrics metrics(TestBuild());
  const std::string text = Scrape(metrics);
  const Tolerance defaults;
  for (const char* family : {"verifyd_diff_rel_l2_bucket", "verifyd_diff_max_abs_bucket"}) {
    for (const char* pair : {"custom_vs_reference", "custom_vs_oracle", "reference_vs_oracle"}) {
      SCOPED_TRACE(std::string(family) + " " + pair);
      const std::vector<std::string> les =
          LeLabels(text, family, std::string("pair=\"") + pair + "\"");
      ASSERT_GT(les.size(), 30u) << text;
      for (const std::string& le : les) EXPECT_TRUE(ShortDecimal(le)) << "le=\"" << le << "\"";
      const std::set<std::string> set(les.begin(), les.end());
      EXPECT_EQ(set.size(), les.size()) << "duplicate edges";
      for (double tol : {defaults.atol, defaults.atol_rel, defaults.rtol, defaults.max_rel_l2,
                         defaults.max_row_rel_l2, defaults.max_abs}) {
        if (tol == 0) continue;  // no floor: nothing to put an edge at
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.3g", tol);
        EXPECT_TRUE(set.count(buf)) << "no edge at the default tolerance " << buf;
      }
      EXPECT_TRUE(set.count("0.01"));
      for (double decade : {1e-4, 1e-3, 1e-2}) {
        EXPECT_GE(EdgesIn(les, decade, decade * 10), 10) << "decade from " << decade;
      }
    }
  }
  // The fine decades, exactly.
  const std::vector<std::string> rel =
      LeLabels(text, "verifyd_diff_rel_l2_bucket", "pair=\"custom_vs_reference\"");
  const std::vector<std::string> want = {
      "0.0001",  "0.000125", "0.00016", "0.0002",  "0.00025", "0.00032", "0.0004", "0.0005",
      "0.00063", "0.0008",   "0.001",   "0.00125", "0.0016",  "0.002",   "0.0025", "0.0032",
      "0.004",   "0.005",    "0.0063",  "0.008",   "0.01",    "0.0125",  "0.016",  "0.02",
      "0.025",   "0.032",    "0.04",    "0.05",    "0.063",   "0.08",    "0.1"};
  auto first = std::find(rel.begin(), rel.end(), "0.0001");
  ASSERT_NE(first, rel.end());
  ASSERT_GE(rel.end() - first, static_cast<long>(want.size()));
  EXPECT_EQ(std::vector<std::string>(first, first + want.size()), want);
  EXPECT_EQ(rel.front(), "1e-06");
  EXPECT_EQ(rel.back(), "10");
}

// Every comparison's largest lse difference, by pair: from 1e-7 (clean pairs differ by a few
// units in the last place of an fp32 lse) to 10, the limits an edge each; a comparison without
// lse is not observed, and a -inf on one side only lands in +Inf.
TEST(MetricsExposition, TheLseDifferenceIsAHistogramWithItsLimitsAsEdges) {
  Metrics metrics(TestBuild());
  DiffStats clean;
  clean.lse_max_abs = 3.8e-6;
  metrics.Diff("custom_vs_reference", clean);
  DiffStats one_sided;
  one_sided.lse_max_abs = std::numeric_limits<double>::infinity();
  metrics.Diff("custom_vs_reference", one_sided);
  metrics.Diff("reference_vs_oracle", DiffStats{});  // no lse: NaN
  const std::string text = Scrape(metrics);
  const std::vector<std::string> les =
      LeLabels(text, "verifyd_diff_lse_max_abs_bucket", "pair=\"custom_vs_reference\"");
  ASSERT_FALSE(les.empty()) << text;
  for (const std::string& le : les) EXPECT_TRUE(ShortDecimal(le)) << "le=\"" << le << "\"";
  EXPECT_EQ(les.front(), "1e-07");
  EXPECT_EQ(les.back(), "10");
  for (double tol : {Tolerance{}.max_lse_abs, 1e-4}) {  // the default, and the derived limit
    char limit[32];
    std::snprintf(limit, sizeof limit, "%.3g", tol);
    EXPECT_NE(std::find(les.begin(), les.end(), limit), les.end()) << "no edge at " << limit;
  }
  EXPECT_NE(text.find("verifyd_diff_lse_max_abs_count{pair=\"custom_vs_reference\"} 2"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find("verifyd_diff_lse_max_abs_bucket{pair=\"custom_vs_reference\",le=\"1e-05\"} 1"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("verifyd_diff_lse_max_abs_count{pair=\"reference_vs_oracle\"} 0"),
            std::string::npos)
      << text;
}

TEST(MetricsExposition, LatencyBucketsAreExactDecimals) {
  Metrics metrics(TestBuild());
  metrics.Request("reference", absl::StatusCode::kOk, 0.003);
  metrics.PathDuration(Path::kReference, 0.003);
  const std::string text = Scrape(metrics);
  for (const char* family :
       {"verifyd_request_duration_seconds_bucket", "verifyd_path_duration_seconds_bucket",
        "verifyd_shadow_overhead_seconds_bucket"}) {
    SCOPED_TRACE(family);
    const std::vector<std::string> les = LeLabels(text, family, "");
    ASSERT_FALSE(les.empty()) << text;
    for (const std::string& le : les) EXPECT_TRUE(ShortDecimal(le)) << "le=\"" << le << "\"";
    EXPECT_NE(std::find(les.begin(), les.end(), "0.1"), les.end())
        << "VerifydLatencyHigh's threshold is not an edge";
  }
}

TEST(MetricsExposition, DecimalEdgesArePowersOfTenTimesTheMantissas) {
  EXPECT_EQ(DecimalEdges(-2, 0, {100, 250}), (std::vector<double>{0.01, 0.025, 0.1, 0.25, 1}));
  const std::vector<double> d = DiffBuckets(-5, 1);
  EXPECT_TRUE(std::is_sorted(d.begin(), d.end()));
  EXPECT_EQ(d.front(), 1e-5);
  EXPECT_EQ(d.back(), 10);
}

TEST(MetricsExposition, CountersExistAtZeroFromTheStart) {
  Metrics metrics(TestBuild());
  const std::string text = Scrape(metrics);
  for (const char* series :
       {"verifyd_captures_total{trigger=\"breach\"} 0",
        "verifyd_captures_total{trigger=\"requested\"} 0",
        "verifyd_rollbacks_total{reason=\"error\"} 0",
        "verifyd_comparisons_total{outcome=\"breach\"} 0", "verifyd_oracle_errors_total 0"}) {
    EXPECT_NE(text.find(std::string("\n") + series + "\n"), std::string::npos)
        << series << " missing in\n"
        << text;
  }
}

// verifyd_last_change_info: one series per action at a time, labelled with what the transport
// verified (a TCP peer without a token by its host only), never with the claimed name.
TEST(MetricsExposition, TheLastChangeIsOneSeriesPerActionWithTheVerifiedPeer) {
  Metrics m(BuildInfo{});
  auto series = [&m] {
    std::vector<std::string> out;
    std::istringstream in(prometheus::TextSerializer().Serialize(m.registry()->Collect()));
    for (std::string l; std::getline(in, l);) {
      if (l.rfind("verifyd_last_change_info{", 0) == 0) out.push_back(l);
    }
    std::sort(out.begin(), out.end());  // the family lists them in no fixed order
    return out;
  };
  EXPECT_TRUE(series().empty());
  AuditEntry e;
  e.action = AuditAction::kMode;
  e.origin = AuditOrigin::kClient;
  e.who = "mallory";
  e.peer = "uid:1000(alice)";
  m.LastChange(e);
  EXPECT_EQ(series(), std::vector<std::string>{
                          "verifyd_last_change_info{action=\"mode\",peer=\"uid:1000(alice)\"} 1"});
  struct Case {
    AuditOrigin origin;
    std::string peer, label;
  };
  for (const Case& c : std::vector<Case>{
           {AuditOrigin::kClient, "unverified:ipv4:10.1.2.3:51234", "unverified:ipv4:10.1.2.3"},
           {AuditOrigin::kClient, "unverified:ipv6:[::1]:40000", "unverified:ipv6:[::1]"},
           {AuditOrigin::kClient, "token:1ec1c26b", "token:1ec1c26b"},
           {AuditOrigin::kDaemon, "", "verifyd"},
           {AuditOrigin::kUnknown, "", "unknown"},
           {AuditOrigin::kClient, "uid:7(" + std::string(200, 'x') + ")",
            "uid:7(" + std::string(74, 'x')}}) {
    e.origin = c.origin;
    e.peer = c.peer;
    e.action = AuditAction::kSampleRate;
    m.LastChange(e);
    const std::vector<std::string> now = series();
    ASSERT_EQ(now.size(), 2u) << c.peer;
    EXPECT_EQ(now[0], "verifyd_last_change_info{action=\"mode\",peer=\"uid:1000(alice)\"} 1");
    EXPECT_EQ(now[1], "verifyd_last_change_info{action=\"sample_rate\",peer=\"" + c.label + "\"} 1")
        << c.peer;
  }
}

TEST(MetricsServerHealth, HealthzAnswersAndReadyzFollowsTheCallback) {
  Metrics metrics(TestBuild());
  std::atomic<bool> ready{false};
  auto server = StartServer(metrics, [&ready] { return ready.load(); });
  ASSERT_TRUE(server);
  auto h = Get(server->port(), "/healthz");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(h->body, "ok\n");
  auto r = Get(server->port(), "/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(r->body, "not ready\n");
  ready = true;
  r = Get(server->port(), "/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "ready\n");
  auto missing = Get(server->port(), "/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
}

TEST(MetricsServerHealth, WithoutACallbackReadyzIsReady) {
  Metrics metrics(TestBuild());
  auto server = StartServer(metrics);
  ASSERT_TRUE(server);
  auto r = Get(server->port(), "/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

class DaemonHealth : public testing::DaemonTest {};

TEST_F(DaemonHealth, ReadyOnceServingAndNotAfterAFault) {
  StartDaemon(testing::TestOptions(testing::TestDir("health")));
  const int port = daemon_->metrics_port();
  auto h = Get(port, "/healthz");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto r = Get(port, "/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  // A sticky engine fault takes the daemon out of service: probes must see it.
  daemon_->OnFatal(absl::InternalError("test fault"));
  r = Get(port, "/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  h = Get(port, "/healthz");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

}  // namespace
}  // namespace verifyd
