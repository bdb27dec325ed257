// verifyctl: operate verifyd (status, flip, rollback) and send it traffic.

#include <algorithm>
#include <iostream>
#include <string_view>
#include <vector>

#include "CLI/CLI.hpp"
#include "src/cli/admin_commands.h"
#include "src/cli/fleet_commands.h"
#include "src/cli/replay_handoff.h"
#include "src/common/admin_token.h"
#include "src/common/build_version.h"
#include "src/common/malloc_arenas.h"
#include "src/loadgen/send_command.h"

namespace {

// Edits (insertions, deletions, substitutions) between a and b.
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// "verifyctl: unknown command 'stauts' (did you mean 'status'?); commands: status, flip, ...".
int UnknownCommand(const CLI::App& app, const std::string& word) {
  std::string list, nearest;
  size_t best = 3;  // suggest a command at most 2 edits away
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    const std::string& name = sub->get_name();
    list += (list.empty() ? "" : ", ") + name;
    if (const size_t d = EditDistance(word, name); d < best) {
      best = d;
      nearest = name;
    }
  }
  std::cerr << "verifyctl: unknown command '" << word << "'"
            << (nearest.empty() ? "" : " (did you mean '" + nearest + "'?)")
            << "; commands: " << list << " (verifyctl --help)\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace verifyd::cli;
  QuietGrpcLog();
  // send moves bundles of tens of MB per call: keep freed ones for the next.
  verifyd::KeepFreedMemory(int64_t{1} << 30);
  CLI::App app{"verifyctl: operate verifyd and send it traffic"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "verifyctl " VERIFYD_VERSION " (" VERIFYD_GIT_COMMIT ")");
  // The global options below are accepted before or after the subcommand.
  app.fallthrough();
  GlobalOptions g;
  app.add_option("--target", g.target, "verifyd data plane, HOST:PORT or unix:PATH")
      ->envname("VERIFYD_TARGET")
      ->capture_default_str();
  app.add_option("--admin", g.admin, "verifyd admin, unix:PATH or HOST:PORT")
      ->envname("VERIFYD_ADMIN")
      ->capture_default_str();
  app.add_option("--admin_token_file", g.admin_token_file, "bearer token for a TCP admin");
  app.add_option("--tls_ca_file", g.tls_ca_file,
                 "TLS to TCP addresses: PEM CA that signed verifyd's certificate (verifyd's "
                 "--tls_cert_file)")
      ->envname("VERIFYD_TLS_CA_FILE");
  app.add_option("--tls_cert_file", g.tls_cert_file,
                 "PEM client certificate, for a verifyd with --tls_client_ca_file (mutual TLS)")
      ->envname("VERIFYD_TLS_CERT_FILE");
  app.add_option("--tls_key_file", g.tls_key_file, "PEM private key of --tls_cert_file")
      ->envname("VERIFYD_TLS_KEY_FILE");
  app.add_option("--timeout", g.timeout_s, "seconds per call")->capture_default_str();
  app.add_flag("--json", g.json, "machine-readable output");

  auto* status = app.add_subcommand("status", "mode, gate readiness, diffs, counters, audit");

  FlipOptions flip;
  auto* f =
      app.add_subcommand("flip", "change what is served: custom | canary | shadow | reference");
  f->add_option("mode", flip.mode, "custom, canary, shadow or reference")->required();
  auto* fraction =
      f->add_option("--fraction", flip.fraction, "canary only: fraction of calls served by custom");
  f->add_option("--reason", flip.reason, "why (recorded in the audit log)")->required();
  f->add_flag("--force", flip.force, "skip the flip gate (recorded)");

  std::string rollback_reason;
  auto* rb = app.add_subcommand("rollback", "back to shadow now");
  rb->add_option("--reason", rollback_reason, "why (recorded in the audit log)")->required();

  SendOptions send;
  auto* s = app.add_subcommand("send", "send random bundles and print a latency summary");
  AddSendOptions(s, &send);

  SampleOptions sample;
  auto* sm = app.add_subcommand("sample", "fraction of calls that also run the non-served path");
  sm->add_option("mode", sample.mode, "shadow or custom")->required();
  sm->add_option("rate", sample.rate, "fraction in [0, 1]")->required();
  sm->add_option("--reason", sample.reason, "why (recorded in the audit log)")->required();
  sm->add_flag("--force", sample.force,
               "allow a custom rate of 0, which leaves the served custom path unchecked (no "
               "rollback can fire; recorded)");

  int64_t capture_next = 0;
  auto* cap = app.add_subcommand("capture", "capture the next N compared calls to disk");
  cap->add_option("--next", capture_next, "calls to capture (0 cancels)")->required();

  auto* probe = app.add_subcommand(
      "probe", "run the daemon's probe suite now and print every probe (exit 1 when one fails)");

  auto* rp = app.add_subcommand("replay",
                                "re-run the paths on captured or golden bundles (runs "
                                "verifyd-replay with the arguments that follow; see its --help)");
  rp->fallthrough(false);  // every argument after `replay` is verifyd-replay's
  rp->allow_extras();

  FleetOptions fleet_opts;
  auto* fleet = AddFleetCommands(&app, &fleet_opts);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // A misspelt command is left over as an extra word: name it, not "a subcommand is required".
    if (app.get_subcommands().empty()) {
      for (const std::string& word : app.remaining()) {
        if (!word.empty() && word[0] != '-') return UnknownCommand(app, word);
      }
    }
    return app.exit(e);
  }
  flip.fraction_given = fraction->count() > 0;
  if (!g.admin_token_file.empty()) {
    auto token = verifyd::ReadAdminTokenFile("--admin_token_file", g.admin_token_file, false);
    if (!token.ok()) return Fail(g, "token", std::string(token.status().message()));
    g.admin_token = *token;
  }
  if (absl::Status st = LoadTls(&g); !st.ok()) return Fail(g, "tls", std::string(st.message()));
  if (*fleet) return RunFleet(g, *fleet, fleet_opts);
  if (!*rp) {
    const bool data = static_cast<bool>(*s);
    if (absl::Status st = CheckAddress(data ? "--target" : "--admin", data ? g.target : g.admin);
        !st.ok()) {
      return Fail(g, data ? "send" : app.get_subcommands()[0]->get_name(),
                  std::string(st.message()));
    }
  }
  if (*sm) return RunSample(g, sample);
  if (*cap) return RunCapture(g, capture_next);
  if (*probe) return RunProbe(g);
  if (*rp) {
    std::vector<std::string> args = rp->remaining();
    if (g.json && std::find(args.begin(), args.end(), "--json") == args.end()) {
      args.push_back("--json");
    }
    return HandOverToReplay(args);
  }
  if (*status) return RunStatus(g);
  if (*f) return RunFlip(g, flip);
  if (*rb) return RunRollback(g, rollback_reason);
  if (*s) return RunSend(g, send);
  return 2;
}
