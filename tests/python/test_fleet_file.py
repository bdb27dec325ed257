"""Nodes following a fleet's desired state from a file, as Kubernetes mounts a ConfigMap: real
verifyd daemons (CPU engine), each with --fleet_file on the same volume and a node name of its
own; the volume updated as the kubelet does it (a new directory, the ..data symlink swapped).

Seeds are fixed per test and printed; run through run_tests.py, which finds the binary.
"""

import json
import os
import re
import shutil
import tempfile
import time
import unittest

import numpy as np

from random_bundles import random_bundle
from verifyd_client import AdminClient, VerifyClient
from verifyd_daemon import Daemon


class ConfigMapVolume:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="verifyd-fleet-")
        self.file = os.path.join(self.dir, "fleet.json")
        self.versions = 0

    def publish(self, state):
        self.versions += 1
        version = f"..2026_12_06_{self.versions}"
        os.mkdir(os.path.join(self.dir, version))
        with open(os.path.join(self.dir, version, "fleet.json"), "w") as f:
            f.write(state if isinstance(state, str) else json.dumps(state))
        tmp = os.path.join(self.dir, "..data_tmp")
        os.symlink(version, tmp)
        os.rename(tmp, os.path.join(self.dir, "..data"))
        if not os.path.islink(self.file):
            os.symlink("..data/fleet.json", self.file)

    def write_in_place(self, text):
        os.remove(self.file)
        with open(self.file, "w") as f:
            f.write(text)

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def metric(daemon, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", daemon.metrics(), re.M)
    return float(m.group(1)) if m else None


def wait_for(fn, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    return fn()


class FleetFileTest(unittest.TestCase):
    def setUp(self):
        self.volume = ConfigMapVolume()
        self.volume.publish({"generation": 1, "mode": "shadow", "reason": "fleet set up"})
        self.nodes = {}
        for name in ("node-a", "node-b"):
            self.nodes[name] = Daemon(f"--fleet_file={self.volume.file}", f"--node_name={name}",
                                      "--gate_window=2")

    def tearDown(self):
        for d in self.nodes.values():
            d.stop()
        self.volume.remove()

    def status(self, name):
        with AdminClient(self.nodes[name].admin) as a:
            return a.status()

    def test_a_step_flips_its_nodes_and_a_gate_still_refuses(self):
        seed = 4001
        print(f"\n  seed {seed}")
        for name, d in self.nodes.items():
            self.assertEqual(metric(d, "verifyd_fleet_source_up"), 1.0, name)
            self.assertEqual(metric(d, 'verifyd_fleet_generation{of="acted"}'), 1.0, name)
        # Step 1: node-b alone is asked for reference; node-a stays at the stable mode.
        self.volume.publish({"generation": 2, "mode": "reference",
                             "step": {"nodes": ["node-b"]}, "reason": "r1 step 1"})
        self.assertTrue(wait_for(lambda: self.status("node-b")["mode"] == "reference"))
        last = self.status("node-b")["audit"][-1]
        self.assertEqual((last["to"], last["who"]), ("reference", "fleet"))
        self.assertIn("fleet generation 2 (in its step): r1 step 1", last["reason"])
        self.assertTrue(wait_for(
            lambda: metric(self.nodes["node-a"], 'verifyd_fleet_generation{of="acted"}') == 2))
        self.assertEqual(self.status("node-a")["mode"], "shadow")
        self.assertEqual(metric(self.nodes["node-a"], "verifyd_fleet_in_step"), 0.0)
        fleet = self.status("node-a")["fleet"]
        self.assertEqual((fleet["node"], fleet["file"], fleet["source_up"]),
                         ("node-a", self.volume.file, True))
        self.assertEqual((fleet["generation_acted"], fleet.get("in_step", False),
                          fleet["last_outcome"], fleet["last_detail"]),
                         (2, False, "applied", "shadow"))
        self.assertEqual(metric(self.nodes["node-b"], "verifyd_fleet_in_step"), 1.0)

        # Custom for every node: node-a's gate has seen clean comparisons and passes; node-b's
        # has seen none and refuses, which its metrics and log report. Neither is forced.
        rng = np.random.default_rng(seed)
        b = random_bundle(rng, batch=1, draft=2, heads=2, page_size=4, prefixes=[7])
        with VerifyClient(self.nodes["node-a"].data, timeout=60) as c:
            for _ in range(2):
                self.assertTrue(c.verify(**b, compare_sync=True).comparison["match"])
        self.volume.publish({"generation": 3, "mode": "custom", "reason": "r1 step 2"})
        self.assertTrue(wait_for(lambda: self.status("node-a")["mode"] == "custom"))
        node_b = self.nodes["node-b"]
        self.assertTrue(wait_for(
            lambda: metric(node_b, 'verifyd_fleet_proposals_total{outcome="refused"}') == 1))
        self.assertEqual(self.status("node-b")["mode"], "reference")
        self.assertIn("fleet: generation 3: custom refused", node_b.log())
        fleet = self.status("node-b")["fleet"]
        self.assertEqual((fleet["generation_acted"], fleet["last_outcome"]), (3, "refused"))
        self.assertTrue(fleet["last_detail"].startswith("custom refused: "), fleet["last_detail"])
        self.assertEqual(
            metric(self.nodes["node-a"], 'verifyd_fleet_proposals_total{outcome="applied"}'), 3)

        # A file caught half written changes nothing and reports the source down; the valid
        # state after it is followed.
        self.volume.write_in_place('{"generation": 4, "mode": "sha')
        for d in self.nodes.values():
            self.assertTrue(wait_for(lambda d=d: metric(d, "verifyd_fleet_source_up") == 0))
        self.assertEqual(self.status("node-a")["mode"], "custom")
        fleet = self.status("node-a")["fleet"]
        self.assertFalse(fleet.get("source_up", False))
        self.assertTrue(fleet["source_error"].startswith("desired state: not JSON"),
                        fleet["source_error"])
        self.volume.write_in_place('{"generation": 4, "mode": "shadow", "reason": "r1 aborted"}')
        for name in self.nodes:
            self.assertTrue(wait_for(lambda name=name: self.status(name)["mode"] == "shadow"),
                            name)
            self.assertEqual(metric(self.nodes[name], "verifyd_fleet_source_up"), 1.0)


if __name__ == "__main__":
    unittest.main()
