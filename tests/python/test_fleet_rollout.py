"""The rollout controller (`verifyctl fleet`) against a real etcd, a real Prometheus scraping the
nodes, and real verifyd daemons (CPU engine) following the fleet's desired state from etcd, all
on loopback ports of their own: 8 nodes promoted shadow → custom in three steps (1 node, 25%,
100%) with the analysis passing; 8 nodes where a refusal holds a step and an injected fault on
two of them rolls the whole fleet back; etcd lost in the middle of a run (past
--etcd_lost_timeout the run ends, writing nothing; within it nothing moves until etcd is back,
then the run goes on). The promotion's time and the rollback's are printed against the targets
in deploy/README.md ("Fleet rollouts"): 8 nodes promoted in at most 3 steps in under 2 minutes,
every node rolled back within 10 s of the failing query.

The nodes' names are chosen for where they hash (desired_state.h): node-5 0.075, node-2 0.196,
node-3 0.327, node-7 0.446, node-0 0.456, node-1 0.570, node-4 0.677, node-6 0.760; echo 0.077,
papa 0.337, mike 0.749.

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
NODES = [f"node-{i}" for i in range(8)]
FAULTY = ("node-3", "node-6")
INTERVAL_S = 1  # the plans' analysis_interval_s
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
    """One Prometheus scraping targets (host:port) every second, its data in a temp dir. Its
    first scrape comes about 5 s after it starts (its discovery's update period), so it starts
    first; set_targets() names them once they listen, then wait_up()."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="verifyd-prom-")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.set_targets([])
        with open(os.path.join(self.dir, "prometheus.yml"), "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "  - job_name: verifyd\n"
                    f"    file_sd_configs: [{{files: [{self.dir}/targets.json]}}]\n")
        log = open(os.path.join(self.dir, "log"), "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir}/prometheus.yml",
             f"--storage.tsdb.path={self.dir}/data", f"--web.listen-address={self.url[7:]}",
             "--log.level=warn"], stdout=log, stderr=log)
        log.close()

    def set_targets(self, targets):
        self.targets = targets
        path = os.path.join(self.dir, "targets.json")
        with open(path + ".new", "w") as f:
            json.dump([{"targets": targets, "labels": {"app": "verifyd"}}], f)
        os.replace(path + ".new", path)

    def wait_up(self):
        up = f"count(up == 1) == {len(self.targets)}"
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


class Run:
    """`verifyctl fleet ... run` in the background; each line of its output with when it came."""

    def __init__(self, test, *args):
        self.proc = subprocess.Popen([os.environ["VERIFYCTL_BIN"], "fleet",
                                      f"--etcd={test.etcd.endpoint}", f"--prefix={PREFIX}",
                                      f"--plan={test.plan}", "run", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        test.addCleanup(self.stop)
        self.lines = []  # (time.monotonic(), line)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def text(self):
        return "".join(line for _, line in list(self.lines))

    def said(self, text):
        """When the first line with `text` came; None before that."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def wait(self, seconds):
        try:
            rc = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.stop()
            rc = None
        self.reader.join(5)
        return rc

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@unittest.skipUnless(os.access(ETCD, os.X_OK) and os.access(PROMETHEUS, os.X_OK),
                     f"{ETCD} or {PROMETHEUS} is absent (apt-get install etcd-server prometheus)")
class FleetRolloutTest(unittest.TestCase):
    def start_fleet(self, nodes, steps, clean=None):
        """nodes: {name: extra verifyd flags}, one etcd and one Prometheus for them all, and 2
        clean comparisons on each node of `clean` (default: every node), enough for a gate of
        --gate_window=2; a plan of `steps` for custom, 2 s of analysis a step."""
        self.prom = Prometheus()
        self.addCleanup(self.prom.stop)
        self.etcd = Etcd()
        self.etcd.start()
        self.addCleanup(self.etcd.remove)
        self.nodes = {}
        for name, flags in nodes.items():
            self.nodes[name] = Daemon(f"--fleet_etcd={self.etcd.endpoint}",
                                      f"--fleet_etcd_prefix={PREFIX}", f"--node_name={name}",
                                      *flags)
            self.addCleanup(self.nodes[name].stop)
        # Each node's stop waits for its exit: all of them told first, they exit together.
        self.addCleanup(lambda: [d.proc.terminate() for d in self.nodes.values()
                                 if d.proc.poll() is None])
        self.prom.set_targets([d.metrics_url.split("/")[2] for d in self.nodes.values()])
        for name in nodes if clean is None else clean:
            self.send(name, 2, True)
        self.prom.wait_up()
        self.plan = os.path.join(self.prom.dir, "plan.json")
        self.write_plan(steps, 2)

    def write_plan(self, steps, step_duration_s):
        with open(self.plan, "w") as f:
            json.dump({"name": "t", "mode": "custom", "stable_mode": "shadow", "steps": steps,
                       "step_duration_s": step_duration_s, "analysis_interval_s": INTERVAL_S,
                       "settle_timeout_s": 15, "prometheus": self.prom.url, "queries": QUERIES},
                      f)

    def fleet(self, *args, json_out=True):
        r = subprocess.run([os.environ["VERIFYCTL_BIN"], *(["--json"] if json_out else []),
                            "fleet", f"--etcd={self.etcd.endpoint}", f"--prefix={PREFIX}",
                            f"--plan={self.plan}", *args],
                           capture_output=True, text=True, check=False, timeout=120)
        return r.returncode, (json.loads(r.stdout) if json_out and r.stdout else r.stdout), r

    def status(self, name):
        with AdminClient(self.nodes[name].admin) as a:
            return a.status()

    def mode(self, name):
        return self.status(name)["mode"]

    def audit(self, name):
        return self.status(name)["audit"]

    def send(self, name, count, match):
        b = random_bundle(np.random.default_rng(3), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[7])
        with VerifyClient(self.nodes[name].data, timeout=60) as c:
            for _ in range(count):
                self.assertEqual(c.verify(**b, compare_sync=True).comparison["match"], match)

    def test_eight_nodes_promote_in_three_steps_with_the_analysis_passing(self):
        self.start_fleet({n: ["--gate_window=2"] for n in NODES}, [0.125, 0.25, 1.0])
        start = time.monotonic()
        rc, out, r = self.fleet("run", json_out=False)
        took = time.monotonic() - start
        self.assertEqual(rc, 0, r.stdout + r.stderr)
        # 1 node, then 2 (25%), then 8.
        for generation, in_step in ((1, 1), (2, 2), (3, 8)):
            self.assertIn(f"every node acted on generation {generation}: {in_step} of 8 in the "
                          "step", out)
        for step in ("step 1 of 3 (0.125)", "step 2 of 3 (0.25)", "step 3 of 3 (1)"):
            self.assertIn(f"{step} passed its analysis for 2 s", out)
        self.assertIn("complete: rollout t complete at step 3 of 3 (1)", out)
        print(f"\n8 nodes shadow -> custom in 3 steps (1 node, 25%, 100%; 2 s of analysis a "
              f"step, 20 s query windows): {took:.1f} s (target: at most 3 steps, under 120 s)")
        self.assertLess(took, 120)
        for n in self.nodes:
            self.assertEqual(self.mode(n), "custom", n)
            self.assertEqual(self.audit(n)[-1]["who"], "fleet")

        rc, st, _ = self.fleet("status")
        self.assertEqual(rc, 0)
        self.assertEqual((st["step"], st["desired"]["mode"], st["desired"]["step"]["fraction"]),
                         (2, "custom", 1.0))
        self.assertEqual(st["totals"], {"nodes": 8, "modes": {"custom": 8}, "in_step": 8,
                                        "refused": 0, "source_down": 0})
        rc, _, r = self.fleet("promote")
        self.assertEqual(rc, 1)
        self.assertIn("at its last step already", r.stdout)

    def test_a_refusal_holds_a_step_and_a_fault_on_two_nodes_rolls_the_fleet_back(self):
        # node-4's gate needs 1000 comparisons; node-3's and node-6's custom kernel is wrong, so
        # that their gates never open and every comparison they make breaches.
        flags = {n: ["--gate_window=2"] for n in NODES}
        flags["node-4"] = ["--gate_window=1000"]
        for n in FAULTY:
            flags[n].append("--inject_custom_fault=perturb:1")
        self.start_fleet(flags, [0.125, 0.25, 1.0],
                         clean=[n for n in NODES if n not in FAULTY and n != "node-4"])

        # Steps 1 and 2 pass; at step 3 the three refuse (closed gates): the step holds.
        rc, out, r = self.fleet("run", json_out=False)
        self.assertEqual(rc, 3, r.stdout + r.stderr)
        self.assertIn("step 2 of 3 (0.25) passed its analysis", out)
        self.assertRegex(out, r"held: 3 node\(s\) refused generation 3: node-3: custom refused: "
                              r"gate: .*; node-4: custom refused: gate: .*; node-6: custom "
                              r"refused: gate: ")
        rc, st, _ = self.fleet("status")
        self.assertEqual((st["step"], st["totals"]["refused"], st["totals"]["modes"]),
                         (2, 3, {"custom": 5, "shadow": 3}))
        refused = {n["node"]: n for n in st["nodes"] if n["last_outcome"] == "refused"}
        self.assertEqual(sorted(refused), ["node-3", "node-4", "node-6"])
        self.assertIn("gate", refused["node-4"]["last_detail"])
        rc, text, _ = self.fleet("status", json_out=False)
        self.assertIn("totals      8 nodes (5 custom, 3 shadow); 8 in step; 3 refused; "
                      "0 source down", text)

        # Undo: back to step 2 (node-5 and node-2 custom, the others shadow), a new generation.
        rc, out, _ = self.fleet("undo")
        self.assertEqual((rc, out["desired"]["generation"], out["desired"]["step"]["fraction"]),
                         (0, 4, 0.25))
        step2 = {n: "custom" if n in ("node-2", "node-5") else "shadow" for n in NODES}
        self.assertTrue(wait_for(lambda: {n: self.mode(n) for n in NODES} == step2))

        # A run at step 2, its analysis passing; then the faulty nodes get traffic. Once
        # Prometheus has their breaches, the next analysis round fails and the whole fleet goes
        # back to shadow, each node's audit naming the query and its value.
        self.write_plan([0.125, 0.25, 1.0], 30)
        run = Run(self)
        self.assertTrue(wait_for(lambda: run.said("every node acted on generation 5"), 15),
                        run.text())
        self.assertTrue(wait_for(lambda: run.said("analysis: pass"), 5), run.text())
        for n in FAULTY:
            self.send(n, 2, False)
        seen = wait_for(lambda: (self.prom.query(QUERIES[0]["query"]) or 0) > 0
                        and time.monotonic(), 15)
        self.assertTrue(seen, run.text())
        failed = wait_for(lambda: run.said("analysis: FAIL"), 10)
        self.assertTrue(failed, run.text())

        def rolled_back(n):
            st = self.status(n)
            return st["mode"] == "shadow" and "aborted" in st["audit"][-1]["reason"]

        back = wait_for(lambda: all(rolled_back(n) for n in NODES) and time.monotonic(), 10)
        self.assertTrue(back, {n: self.status(n)["audit"][-1] for n in NODES})
        self.assertEqual(run.wait(10), 4, run.text())
        print(f"\nrollback of 8 nodes: the failing query {failed - seen:+.2f} s after Prometheus "
              f"had the breaches, every node in shadow {back - failed:.2f} s after the failing "
              f"query, {back - seen:.2f} s after the breaches were seen (targets: within one "
              f"analysis interval, {INTERVAL_S} s; within 10 s of the failing query)")
        self.assertLess(back - failed, 10)
        self.assertLess(back - seen, INTERVAL_S + 2)
        self.assertRegex(run.text(), r"rolled_back: analysis failed at step 2 of 3 \(0\.25\): "
                                     r"breach_rate = (0\.\d+|1) \(max 0\)")
        for n in NODES:
            last = self.audit(n)[-1]
            self.assertEqual((last["from"], last["to"], last["who"]), (step2[n], "shadow", "fleet"),
                             n)
            self.assertRegex(last["reason"], r"rollout t aborted: analysis failed at step 2 of 3 "
                                             r"\(0\.25\): breach_rate = (0\.\d+|1) \(max 0\)", n)
        rc, st, _ = self.fleet("status")
        self.assertEqual((st["step"], st["desired"]["mode"], st["totals"]["modes"]),
                         (-1, "shadow", {"shadow": 8}))

        # abort and the plan's errors: a bad field is named.
        rc, out, _ = self.fleet("abort", "--reason", "drill")
        self.assertEqual((rc, out["desired"]["mode"]), (0, "shadow"))
        self.assertIn("aborted: drill", out["desired"]["reason"])
        with open(self.plan, "w") as f:
            json.dump({"name": "t", "mode": "custom", "steps": [0.5, 0.25]}, f)
        rc, _, r = self.fleet("promote")
        self.assertEqual(rc, 1)
        self.assertIn("steps[1]: 0.25 is not above the step before it", r.stdout + r.stderr)

    def test_etcd_lost_mid_run_ends_it_past_the_bound_or_holds_it_until_etcd_is_back(self):
        self.start_fleet({n: ["--gate_window=2"] for n in ("papa", "echo", "mike")}, [0.5, 1.0])
        held = {"papa": "custom", "echo": "custom", "mike": "shadow"}  # at step 1
        rc, _, r = self.fleet("run", "--etcd_lost_timeout=-1", json_out=False)
        self.assertEqual(rc, 1)
        self.assertIn("--etcd_lost_timeout: -1 is not seconds >= 0", r.stderr + r.stdout)

        # A run that waits at most 3 s for a lost etcd. Step 1 is taken; then etcd goes, and is
        # not started again while the run lasts. Step 1's analysis (2 s) needs no etcd; the run
        # then waits 3 s for it and ends, exit 5, naming the endpoint, the step and the
        # generation it left; nothing is written.
        run = Run(self, "--etcd_lost_timeout=3")
        self.assertTrue(wait_for(lambda: run.said("every node acted on generation 1"), 15),
                        run.text())
        self.etcd.kill()
        killed = time.monotonic()
        rc = run.wait(30)
        ended = time.monotonic()
        out = run.text()
        self.assertEqual(rc, 5, out)
        self.assertIn("step 1 of 2 (0.5) passed its analysis", out)
        self.assertIn("waiting for it (at most 3 s), the desired state unchanged", out)
        self.assertIn(f"etcd_lost: etcd {self.etcd.endpoint} did not answer for 3 s (", out)
        self.assertIn(f"gave up at step 1 of 2 (0.5), {PREFIX}/desired last known at "
                      "generation 1; fleet run goes on from it once etcd answers", out)
        self.assertNotIn("step 2 of 2", out)
        self.assertNotIn("rolled back", out)
        self.assertLess(ended - killed, 2 + 3 + 5)
        # The nodes hold their modes, their source down.
        self.assertTrue(wait_for(lambda: all(metric(d, "verifyd_fleet_source_up") == 0
                                             for d in self.nodes.values()), 5))
        for n in held:
            self.assertFalse(self.status(n)["fleet"]["source_up"], n)
        self.assertEqual({n: self.mode(n) for n in held}, held)
        # etcd back once the run is over: the desired state is the one the run left.
        self.etcd.start()
        desired = json.loads(self.etcd.get(f"{PREFIX}/desired")[0])
        self.assertEqual((desired["generation"], desired["mode"], desired["step"]),
                         (1, "custom", {"fraction": 0.5}))

        # A run with the default bound goes on from step 1 (generation 2); etcd goes again.
        start = time.monotonic()
        run = Run(self)
        self.assertTrue(wait_for(lambda: run.said("every node acted on generation 2"), 15),
                        run.text())
        self.etcd.kill()
        self.assertTrue(wait_for(lambda: all(metric(d, "verifyd_fleet_source_up") == 0
                                             for d in self.nodes.values()), 5))
        # Step 1's analysis passes meanwhile, yet step 2 is not written: the run waits.
        self.assertTrue(wait_for(lambda: run.said("step 1 of 2 (0.5) passed its analysis"), 10),
                        run.text())
        self.assertTrue(wait_for(lambda: run.said("etcd lost"), 5), run.text())
        self.assertIn("waiting for it (at most 900 s)", run.text())
        time.sleep(2)
        self.assertIsNone(run.proc.poll(), run.text())
        self.assertFalse(run.said("step 2 of 2"), run.text())
        self.assertFalse(run.said("rolled back"), run.text())
        self.assertEqual({n: self.mode(n) for n in held}, held)

        # etcd is back on the same data and port: the run goes on to the last step.
        self.etcd.start()
        rc = run.wait(20)
        out = run.text()
        self.assertEqual(rc, 0, out)
        self.assertIn("etcd back after", out)
        self.assertIn("step 2 of 2 (1): generation 3", out)
        self.assertIn("complete: rollout t complete at step 2 of 2 (1)", out)
        self.assertNotIn("rolled back", out)
        for n in self.nodes:
            self.assertEqual(self.mode(n), "custom", n)
            self.assertEqual(metric(self.nodes[n], "verifyd_fleet_source_up"), 1.0, n)
            last = self.audit(n)[-1]
            self.assertEqual((last["to"], last["who"]), ("custom", "fleet"), n)
        rc, st, _ = self.fleet("status")
        self.assertEqual((rc, st["desired"]["generation"], st["totals"]["modes"],
                          st["totals"]["source_down"]), (0, 3, {"custom": 3}, 0))
        self.assertLess(time.monotonic() - start, 40)

if __name__ == "__main__":
    unittest.main()
