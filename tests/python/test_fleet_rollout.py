"""The rollout controller (`verifyctl fleet`) against a real etcd, a real Prometheus scraping the
nodes, and real verifyd daemons (CPU engine) following the fleet's desired state from etcd, all
on loopback ports of their own: a staged promotion whose analysis passes, a node that refuses
holding its step, a node with an injected fault whose breaches roll the whole fleet back, and
etcd lost in the middle of a run (nothing moves until it is back, then the run goes on).

The nodes' names are chosen for where they hash (desired_state.h): papa 0.015, echo 0.188,
hotel 0.26, india 0.515, golf 0.613, mike 0.852, kilo 0.936.

Run through run_tests.py, which finds verifyd; VERIFYCTL_BIN names verifyctl. Skipped without
/usr/bin/etcd or /usr/bin/prometheus.
"""

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.parse
import urllib.request

import numpy as np

from random_bundles import random_bundle
from test_fleet_etcd import ETCD, Etcd, free_port, metric, wait_for
from verifyd_client import AdminClient, VerifyClient
from verifyd_daemon import Daemon

PROMETHEUS = "/usr/bin/prometheus"
PREFIX = "/verifyd/r"
WINDOW = "20s"
QUERIES = [
    {"name": "breach_rate",
     "query": f'(sum(increase(verifyd_comparisons_total{{outcome="breach"}}[{WINDOW}])) '
              f'or vector(0)) / clamp_min(sum(increase(verifyd_comparisons_total'
              f'{{outcome=~"match|breach"}}[{WINDOW}])) or vector(0), 1)',
     "max": 0},
    {"name": "tap_breaches",
     "query": f'sum(increase(verifyd_tap_breaches_total{{pair="custom_vs_reference"}}'
              f'[{WINDOW}])) or vector(0)',
     "max": 0},
    {"name": "drift_breaches",
     "query": f"sum(increase(verifyd_drift_breaches_total[{WINDOW}])) or vector(0)", "max": 0},
    {"name": "probe_failures",
     "query": f"sum(increase(verifyd_probe_failures_total[{WINDOW}])) or vector(0)", "max": 0},
    {"name": "rollbacks",
     "query": f"sum(increase(verifyd_rollbacks_total[{WINDOW}])) or vector(0)", "max": 0},
]


class Prometheus:
    """One Prometheus scraping `targets` (host:port) every second, its data in a temp dir."""

    def __init__(self, targets):
        self.dir = tempfile.mkdtemp(prefix="verifyd-prom-")
        self.url = f"http://127.0.0.1:{free_port()}"
        with open(os.path.join(self.dir, "prometheus.yml"), "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "  - job_name: verifyd\n"
                    f"    static_configs: [{{targets: {json.dumps(targets)}, "
                    "labels: {app: verifyd}}]\n")
        log = open(os.path.join(self.dir, "log"), "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir}/prometheus.yml",
             f"--storage.tsdb.path={self.dir}/data", f"--web.listen-address={self.url[7:]}",
             "--log.level=warn"], stdout=log, stderr=log)
        log.close()
        up = f"count(up == 1) == {len(targets)}"
        if not wait_for(lambda: self.query(up), 30):
            raise RuntimeError("prometheus did not start scraping every node")

    def query(self, q):
        """The first sample's value, or None (no answer, no sample)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                result = json.loads(r.read())["data"]["result"]
        except OSError:
            return None
        return float(result[0]["value"][1]) if result else None

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@unittest.skipUnless(os.access(ETCD, os.X_OK) and os.access(PROMETHEUS, os.X_OK),
                     f"{ETCD} or {PROMETHEUS} is absent (apt-get install etcd-server prometheus)")
class FleetRolloutTest(unittest.TestCase):
    def start_fleet(self, nodes, steps, step_duration_s=2):
        """nodes: {name: extra verifyd flags}; a plan of `steps` for custom."""
        self.etcd = Etcd()
        self.etcd.start()
        self.addCleanup(self.etcd.remove)
        self.nodes = {}
        for name, flags in nodes.items():
            self.nodes[name] = Daemon(f"--fleet_etcd={self.etcd.endpoint}",
                                      f"--fleet_etcd_prefix={PREFIX}", f"--node_name={name}",
                                      *flags)
            self.addCleanup(self.nodes[name].stop)
        self.prom = Prometheus([d.metrics_url.split("/")[2] for d in self.nodes.values()])
        self.addCleanup(self.prom.stop)
        self.plan = os.path.join(self.prom.dir, "plan.json")
        with open(self.plan, "w") as f:
            json.dump({"name": "t", "mode": "custom", "stable_mode": "shadow", "steps": steps,
                       "step_duration_s": step_duration_s, "analysis_interval_s": 1, "settle_timeout_s": 15,
                       "prometheus": self.prom.url, "queries": QUERIES}, f)

    def fleet(self, *args, json_out=True):
        r = subprocess.run([os.environ["VERIFYCTL_BIN"], *(["--json"] if json_out else []),
                            "fleet", f"--etcd={self.etcd.endpoint}", f"--prefix={PREFIX}",
                            f"--plan={self.plan}", *args],
                           capture_output=True, text=True, check=False, timeout=120)
        return r.returncode, (json.loads(r.stdout) if json_out and r.stdout else r.stdout), r

    def mode(self, name):
        with AdminClient(self.nodes[name].admin) as a:
            return a.status()["mode"]

    def audit(self, name):
        with AdminClient(self.nodes[name].admin) as a:
            return a.status()["audit"]

    def send(self, name, count, match):
        b = random_bundle(np.random.default_rng(3), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[7])
        with VerifyClient(self.nodes[name].data, timeout=60) as c:
            for _ in range(count):
                self.assertEqual(c.verify(**b, compare_sync=True).comparison["match"], match)

    def test_staged_promotion_with_the_analysis_passing(self):
        self.start_fleet({n: ["--gate_window=2"] for n in ("papa", "hotel", "india", "mike")},
                         [0.25, 0.5, 1.0])
        for n in self.nodes:
            self.send(n, 2, True)
        start = time.monotonic()
        rc, out, r = self.fleet("run", json_out=False)
        self.assertEqual(rc, 0, r.stdout + r.stderr)
        self.assertIn("complete: rollout t complete at step 3 of 3 (1)", out)
        for step in ("step 1 of 3 (0.25)", "step 2 of 3 (0.5)", "step 3 of 3 (1)"):
            self.assertIn(f"{step} passed its analysis for 2 s", out)
        self.assertLess(time.monotonic() - start, 30)
        for n in self.nodes:
            self.assertEqual(self.mode(n), "custom", n)
            self.assertEqual(self.audit(n)[-1]["who"], "fleet")

        rc, st, _ = self.fleet("status")
        self.assertEqual(rc, 0)
        self.assertEqual((st["step"], st["desired"]["mode"], st["desired"]["step"]["fraction"]),
                         (2, "custom", 1.0))
        self.assertEqual(st["totals"], {"nodes": 4, "modes": {"custom": 4}, "in_step": 4,
                                        "refused": 0, "source_down": 0})
        rc, _, r = self.fleet("promote")
        self.assertEqual(rc, 1)
        self.assertIn("at its last step already", r.stdout)

    def test_a_refusal_holds_the_step_and_a_fault_rolls_the_fleet_back(self):
        # echo (in the first step) has an open gate; golf's gate needs 1000 comparisons; kilo's
        # custom kernel is wrong, so that every comparison it makes breaches.
        self.start_fleet({"echo": ["--gate_window=2"], "golf": ["--gate_window=1000"],
                          "kilo": ["--gate_window=2", "--inject_custom_fault=perturb:1"]},
                         [0.5, 1.0])
        self.send("echo", 2, True)

        # Step 1 passes; at step 2 golf and kilo refuse (closed gates): the step holds.
        rc, out, r = self.fleet("run", json_out=False)
        self.assertEqual(rc, 3, r.stdout + r.stderr)
        self.assertIn("step 1 of 2 (0.5) passed its analysis", out)
        self.assertIn("held: 2 node(s) refused generation 2: golf: custom refused: gate:", out)
        rc, st, _ = self.fleet("status")
        self.assertEqual((st["step"], st["totals"]["refused"], st["totals"]["modes"]),
                         (1, 2, {"custom": 1, "shadow": 2}))
        refused = {n["node"]: n for n in st["nodes"] if n["last_outcome"] == "refused"}
        self.assertEqual(sorted(refused), ["golf", "kilo"])
        self.assertIn("gate", refused["golf"]["last_detail"])
        rc, text, _ = self.fleet("status", json_out=False)
        self.assertIn("totals      3 nodes (1 custom, 2 shadow); 3 in step; 2 refused; "
                      "0 source down", text)

        # Undo: back to step 1 (echo custom, the others shadow), a new generation.
        rc, out, _ = self.fleet("undo")
        self.assertEqual((rc, out["desired"]["generation"], out["desired"]["step"]["fraction"]),
                         (0, 3, 0.5))
        self.assertTrue(wait_for(lambda: self.mode("echo") == "custom"))

        # kilo's comparisons breach; once Prometheus has seen them the analysis fails and the
        # whole fleet goes back to shadow, each node's audit naming the query and its value.
        self.send("kilo", 2, False)
        self.assertTrue(wait_for(lambda: (self.prom.query(QUERIES[0]["query"]) or 0) > 0, 15))
        start = time.monotonic()
        rc, out, r = self.fleet("run", json_out=False)
        self.assertEqual(rc, 4, r.stdout + r.stderr)
        self.assertRegex(out, r"rolled_back: analysis failed at step 1 of 2 \(0\.5\): "
                              r"breach_rate = 0\.\d+ \(max 0\)")
        self.assertTrue(wait_for(lambda: all(self.mode(n) == "shadow" for n in self.nodes), 10))
        self.assertLess(time.monotonic() - start, 15)
        last = self.audit("echo")[-1]
        self.assertEqual((last["from"], last["to"], last["who"]), ("custom", "shadow", "fleet"))
        self.assertRegex(last["reason"], r"rollout t aborted: .*breach_rate = 0\.\d+ \(max 0\)")
        rc, st, _ = self.fleet("status")
        self.assertEqual((st["step"], st["desired"]["mode"], st["totals"]["modes"]),
                         (-1, "shadow", {"shadow": 3}))

        # abort and the plan's errors: a bad field is named.
        rc, out, _ = self.fleet("abort", "--reason", "drill")
        self.assertEqual((rc, out["desired"]["mode"]), (0, "shadow"))
        self.assertIn("aborted: drill", out["desired"]["reason"])
        with open(self.plan, "w") as f:
            json.dump({"name": "t", "mode": "custom", "steps": [0.5, 0.25]}, f)
        rc, _, r = self.fleet("promote")
        self.assertEqual(rc, 1)
        self.assertIn("steps[1]: 0.25 is not above the step before it", r.stdout + r.stderr)

    def test_etcd_lost_mid_run_holds_everything_until_it_is_back(self):
        self.start_fleet({n: ["--gate_window=2"] for n in ("papa", "hotel", "mike")}, [0.5, 1.0])
        for n in self.nodes:
            self.send(n, 2, True)
        start = time.monotonic()
        run = subprocess.Popen([os.environ["VERIFYCTL_BIN"], "fleet", f"--etcd={self.etcd.endpoint}",
                                f"--prefix={PREFIX}", f"--plan={self.plan}", "run"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(lambda: run.poll() is not None or (run.kill(), run.wait()))
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
        reader.start()
        said = lambda text: any(text in line for line in list(lines))

        # Step 1 (papa and hotel custom, mike shadow) is taken; then etcd goes.
        self.assertTrue(wait_for(lambda: said("every node acted on generation 1"), 15),
                        "".join(lines))
        self.etcd.kill()
        held = {"papa": "custom", "hotel": "custom", "mike": "shadow"}
        self.assertTrue(wait_for(lambda: all(metric(d, "verifyd_fleet_source_up") == 0
                                             for d in self.nodes.values()), 5))
        for n in held:
            with AdminClient(self.nodes[n].admin) as a:
                fleet = a.status()["fleet"]
            self.assertFalse(fleet["source_up"], n)
        # Step 1's analysis passes meanwhile, yet step 2 is not written: the run waits.
        self.assertTrue(wait_for(lambda: said("step 1 of 2 (0.5) passed its analysis"), 10),
                        "".join(lines))
        self.assertTrue(wait_for(lambda: said("etcd lost"), 5), "".join(lines))
        time.sleep(2)
        self.assertIsNone(run.poll(), "".join(lines))
        self.assertFalse(said("step 2 of 2"), "".join(lines))
        self.assertFalse(said("rolled back"), "".join(lines))
        self.assertEqual({n: self.mode(n) for n in held}, held)

        # etcd is back on the same data and port: the run goes on to the last step.
        self.etcd.start()
        try:
            rc = run.wait(timeout=20)
        except subprocess.TimeoutExpired:
            run.kill()
            rc = run.wait()
        reader.join(5)
        self.assertEqual(rc, 0, "".join(lines))
        out = "".join(lines)
        self.assertIn("etcd back after", out)
        self.assertIn("step 2 of 2 (1): generation 2", out)
        self.assertIn("complete: rollout t complete at step 2 of 2 (1)", out)
        self.assertNotIn("rolled back", out)
        for n in self.nodes:
            self.assertEqual(self.mode(n), "custom", n)
            self.assertEqual(metric(self.nodes[n], "verifyd_fleet_source_up"), 1.0, n)
            last = self.audit(n)[-1]
            self.assertEqual((last["to"], last["who"]), ("custom", "fleet"), n)
        rc, st, _ = self.fleet("status")
        self.assertEqual((rc, st["desired"]["generation"], st["totals"]["modes"],
                          st["totals"]["source_down"]), (0, 2, {"custom": 3}, 0))
        self.assertLess(time.monotonic() - start, 40)


if __name__ == "__main__":
    unittest.main()
