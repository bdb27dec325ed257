"""A node following a fleet's desired state from etcd (--fleet_etcd): a real verifyd daemon (CPU
engine) and a real etcd (/usr/bin/etcd, Debian's etcd-server) on loopback ports of their own.
The test writes and reads etcd's keys through its JSON gateway (/v3/kv/*), so that it needs no
etcd client: the desired state is followed, the node's status key reports what it did, a killed
etcd is a source down that keeps the mode, and a stopped node's key goes with its lease.

Run through run_tests.py, which finds the binary; skipped without /usr/bin/etcd.
"""

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

from verifyd_client import AdminClient
from verifyd_daemon import Daemon

ETCD = "/usr/bin/etcd"
PREFIX = "/verifyd/t"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def b64(s):
    return base64.b64encode(s.encode()).decode()


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


class Etcd:
    """One etcd member on two free loopback ports, its data in a temporary directory."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="verifyd-etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc = None

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.client_port}"

    def start(self):
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(self.dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [ETCD, "--name=t", f"--data-dir={self.dir}/data", f"--listen-client-urls={client}",
             f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
             f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=t={peer}",
             "--log-level=warn"], stdout=log, stderr=log)
        log.close()
        if not wait_for(lambda: self.get("ping", quiet=True) is not False, 20):
            raise RuntimeError("etcd did not start")

    def kill(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def remove(self):
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _call(self, path, body):
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def put(self, key, value):
        self._call("put", {"key": b64(key), "value": b64(value)})

    def get(self, key, quiet=False):
        """(value, lease) of `key`; None when absent; False when etcd does not answer (quiet)."""
        try:
            r = self._call("range", {"key": b64(key)})
        except OSError:
            if quiet:
                return False
            raise
        kvs = r.get("kvs", [])
        if not kvs:
            return None
        return base64.b64decode(kvs[0]["value"]).decode(), int(kvs[0].get("lease", 0))


@unittest.skipUnless(os.access(ETCD, os.X_OK), f"{ETCD} is absent (apt-get install etcd-server)")
class FleetEtcdTest(unittest.TestCase):
    def setUp(self):
        self.etcd = Etcd()
        self.etcd.start()
        self.etcd.put(f"{PREFIX}/desired", json.dumps({"generation": 1, "mode": "shadow"}))
        self.node = Daemon(f"--fleet_etcd={self.etcd.endpoint}", f"--fleet_etcd_prefix={PREFIX}",
                           "--node_name=node-a", "--gate_window=2")

    def tearDown(self):
        self.node.stop()
        self.etcd.remove()

    def status(self):
        with AdminClient(self.node.admin) as a:
            return a.status()

    def node_key(self):
        v = self.etcd.get(f"{PREFIX}/nodes/node-a", quiet=True)
        return (json.loads(v[0]), v[1]) if v else None

    def test_follows_etcd_reports_back_and_holds_when_it_is_lost(self):
        desired = f"{PREFIX}/desired"
        self.assertTrue(wait_for(lambda: metric(self.node,
                                                'verifyd_fleet_generation{of="acted"}') == 1))
        fleet = self.status()["fleet"]
        self.assertEqual((fleet["node"], fleet["file"], fleet["source_up"]),
                         ("node-a", f"etcd {self.etcd.endpoint}{desired}", True))

        self.etcd.put(desired, json.dumps({"generation": 2, "mode": "reference",
                                           "reason": "r1"}))
        self.assertTrue(wait_for(lambda: self.status()["mode"] == "reference", 5))
        last = self.status()["audit"][-1]
        self.assertEqual((last["to"], last["who"], last["peer"]),
                         ("reference", "fleet", f"fleet etcd {self.etcd.endpoint}{desired}"))

        # The node's status key: what it serves, what it did, under a lease.
        self.assertTrue(wait_for(lambda: (self.node_key() or ({}, 0))[0].get(
            "generation_acted") == 2, 5))
        report, lease = self.node_key()
        self.assertEqual((report["node"], report["mode"], report["gate"], report["last_outcome"],
                          report["source_up"]), ("node-a", "reference", "closed", "applied", True))
        self.assertNotEqual(lease, 0)

        # A custom flip the gate refuses (no clean comparisons yet) is reported with its reason.
        self.etcd.put(desired, json.dumps({"generation": 3, "mode": "custom"}))
        self.assertTrue(wait_for(lambda: (self.node_key() or ({}, 0))[0].get(
            "last_outcome") == "refused", 5))
        report, _ = self.node_key()
        self.assertTrue(report["last_detail"].startswith("custom refused: "),
                        report["last_detail"])
        self.assertEqual(self.status()["mode"], "reference")

        # etcd killed: a source down, the mode kept; back: followed again.
        self.etcd.kill()
        self.assertTrue(wait_for(lambda: metric(self.node, "verifyd_fleet_source_up") == 0, 5))
        self.assertEqual(self.status()["mode"], "reference")
        self.etcd.start()
        self.etcd.put(desired, json.dumps({"generation": 4, "mode": "shadow"}))
        self.assertTrue(wait_for(lambda: self.status()["mode"] == "shadow", 5))
        self.assertEqual(metric(self.node, "verifyd_fleet_source_up"), 1.0)

        # A stopped node revokes its lease: its key goes with it.
        self.node.stop()
        self.assertIsNone(self.node_key())

    def test_fleet_file_and_fleet_etcd_together_are_refused(self):
        r = subprocess.run([os.environ.get("VERIFYD_BIN", ""), "--fleet_file=/tmp/x.json",
                            f"--fleet_etcd={self.etcd.endpoint}"], capture_output=True,
                           text=True, check=False, timeout=30)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--fleet_file and --fleet_etcd", r.stderr + r.stdout)


if __name__ == "__main__":
    unittest.main()
