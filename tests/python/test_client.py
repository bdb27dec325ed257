"""verifyd_client against the real verifyd (CPU engine): calls, compaction, errors, admin, stream.

Seeds are fixed per test and printed; run through run_tests.py, which finds the binary.
"""

import os
import importlib.util
import re
import unittest
from concurrent import futures

import grpc
import numpy as np

from random_bundles import oracle, random_bundle, rel_l2
from verifyd_client import (REQUEST_BYTES_KEY, AdminClient, InvalidBundleError, VerifyClient,
                            VerifydError, from_bf16, make_bundle, pack_mask)
from verifyd_daemon import Daemon

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def rng_for(test, seed):
    print(f"\n  {test.id().rsplit('.', 1)[-1]}: seed {seed}")
    return np.random.default_rng(seed)


class VerifyTest(unittest.TestCase):
    """Data plane in the default mode (shadow: the reference is served)."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.client = VerifyClient(cls.daemon.data, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()

    def test_round_trip_matches_oracle(self):
        b = random_bundle(rng_for(self, 11), batch=2, draft=5, heads=3, page_size=16,
                          prefixes=[37, 0])
        r = self.client.verify(**b, want_lse=True, request_id="rt-1")
        self.assertEqual(r.o.dtype, np.uint16)
        self.assertEqual(r.o.shape, (10, 3, 512))
        self.assertEqual(r.lse.shape, (10, 3))
        self.assertEqual((r.served_path, r.mode, r.request_id), ("reference", "shadow", "rt-1"))
        o = from_bf16(r.o)
        self.assertTrue(np.isfinite(o).all())
        want_o, want_lse = oracle(b)
        self.assertLess(rel_l2(o.astype(np.float64), want_o), 1e-2)
        np.testing.assert_allclose(r.lse, want_lse, atol=1e-3, rtol=1e-4)
        self.assertGreater(r.timing["total"], 0)

    def test_compacted_equals_uncompacted_bit_for_bit(self):
        b = random_bundle(rng_for(self, 12), batch=3, draft=4, heads=2, page_size=8,
                          prefixes=[20, 9, 53], unused_pages=7, spare_pages=2,
                          share_first_page=True)
        full = self.client.verify(**b, want_lse=True, compact=False)
        compact = self.client.verify(**b, want_lse=True, compact=True)
        np.testing.assert_array_equal(compact.o, full.o)
        np.testing.assert_array_equal(compact.lse, full.lse)
        # The compact pool holds each page read once: shared first page deduplicated,
        # spare and unused pages left out.
        lens = b["kv_lens"]
        pages_read = int(sum(-(-lens // 8))) - 2
        self.assertEqual(make_bundle(**b, compact=True).kv_pool.shape[0], pages_read)

    def test_poisoned_pool_compacted(self):
        b = random_bundle(rng_for(self, 13), batch=2, draft=3, heads=4, page_size=1,
                          prefixes=[54, 1], unused_pages=4000)
        self.assertTrue(np.isnan(from_bf16(b["kv_pool"])).mean() > 0.9)
        bundle = make_bundle(**b, compact=True)
        self.assertEqual(bundle.kv_pool.shape[0], 57 + 4)
        self.assertFalse(np.isnan(from_bf16(bundle.kv_pool)).any())
        r = self.client.verify(**b)
        o = from_bf16(r.o).astype(np.float64)
        self.assertTrue(np.isfinite(o).all())
        self.assertLess(rel_l2(o, oracle(b)[0]), 1e-2)
        np.testing.assert_array_equal(self.client.verify(**b, compact=False).o, r.o)

    def test_bit_packed_mask_gives_the_same_output(self):
        b = random_bundle(rng_for(self, 14), batch=2, draft=17, heads=2, page_size=64,
                          prefixes=[97, 1])
        want = self.client.verify(**b).o
        packed = dict(b, tree_mask=pack_mask(b["tree_mask"]))
        self.assertEqual(packed["tree_mask"].shape, (2, 17, 3))
        np.testing.assert_array_equal(self.client.verify(**packed).o, want)
        np.testing.assert_array_equal(
            self.client.verify(**dict(b, tree_mask=b["tree_mask"].astype(bool))).o, want)

    def test_compare_sync_returns_the_comparison(self):
        b = random_bundle(rng_for(self, 15), batch=1, draft=3, heads=2, page_size=4,
                          prefixes=[10])
        r = self.client.verify(**b, compare_sync=True)
        self.assertIsNotNone(r.comparison)
        self.assertEqual((r.comparison["test"], r.comparison["ref"]), ("custom", "reference"))
        self.assertTrue(r.comparison["match"], r.comparison)
        self.assertLess(r.comparison["rel_l2"], 1e-2)

    def assertField(self, err, field, code=grpc.StatusCode.INVALID_ARGUMENT):
        self.assertEqual(err.code, code, err)
        self.assertTrue(err.field and err.field.startswith(field), f"{err.field!r}: {err}")
        self.assertIn(field, str(err))

    def test_bad_inputs_raise_naming_the_field(self):
        b = random_bundle(rng_for(self, 16), batch=2, draft=3, heads=2, page_size=4,
                          prefixes=[5, 6], unused_pages=2)
        cases = {
            "q": dict(b, q=b["q"][:, :, :512]),
            "kv_pool": dict(b, kv_pool=b["kv_pool"][:, :3]),
            "kv_indices": dict(b, kv_indices=np.where(np.arange(len(b["kv_indices"])) == 1,
                                                       10_000, b["kv_indices"])),
            "kv_indptr": dict(b, kv_indptr=b["kv_indptr"][:-1]),
            "kv_lens": dict(b, kv_lens=np.array([2, 9], dtype=np.int32)),
            "tree_mask": dict(b, tree_mask=b["tree_mask"] * 2),
            "sm_scale": dict(b, sm_scale=float("nan")),
        }
        for field, bad in cases.items():
            for compact in (True, False):
                with self.subTest(field=field, compact=compact):
                    with self.assertRaises(InvalidBundleError) as cm:
                        self.client.verify(**bad, compact=compact)
                    self.assertField(cm.exception, field)
        with self.assertRaises(InvalidBundleError) as cm:
            self.client.verify(**dict(b, q=from_bf16(b["q"])))
        self.assertField(cm.exception, "q")
        self.assertIn("float32", cm.exception.message)
        # One the server answers: the CPU engine serves device 0 only.
        with self.assertRaises(VerifydError) as cm:
            self.client.verify(**b, device=3)
        self.assertNotIsInstance(cm.exception, InvalidBundleError)
        self.assertField(cm.exception, "device")

    def test_unknown_transport(self):
        with self.assertRaises(ValueError):
            VerifyClient(self.daemon.data, transport="carrier-pigeon")

    def test_stream_in_order_and_survives_an_error(self):
        rng = rng_for(self, 17)
        bundles = [random_bundle(rng, batch=1 + i % 2, draft=2 + i, heads=2, page_size=8,
                                 prefixes=[3 * i + 1] * (1 + i % 2)) for i in range(4)]
        want = [self.client.verify(**b).o for b in bundles]
        with self.client.stream() as s:
            for i, b in enumerate(bundles):
                s.send(**b, request_id=f"s{i}")
            for i in range(len(bundles)):
                r = s.recv()
                self.assertEqual(r.request_id, f"s{i}")
                np.testing.assert_array_equal(r.o, want[i])
            with self.assertRaises(VerifydError) as cm:
                s.verify(**bundles[0], device=5)
            self.assertField(cm.exception, "device")
            np.testing.assert_array_equal(s.verify(**bundles[1], want_lse=True).o, want[1])

    def test_channel_matches_unary_and_survives_an_error(self):
        rng = rng_for(self, 19)
        bundles = [random_bundle(rng, batch=1 + i % 2, draft=2 + i, heads=3, page_size=4,
                                 prefixes=[5 * i + 2] * (1 + i % 2)) for i in range(3)]
        want = [self.client.verify(**b, want_lse=True) for b in bundles]
        with self.client.channel(byte_size=1 << 20) as ch:
            for i, b in enumerate(bundles):
                r = ch.verify(**b, want_lse=True, request_id=f"c{i}")
                self.assertEqual(r.request_id, f"c{i}")
                np.testing.assert_array_equal(r.o, want[i].o)
                np.testing.assert_array_equal(r.lse, want[i].lse)
            with self.assertRaises(VerifydError) as cm:
                ch.verify(**bundles[0], device=5)
            self.assertField(cm.exception, "device")
            np.testing.assert_array_equal(ch.verify(**bundles[1]).o, want[1].o)
            big = random_bundle(rng, batch=1, draft=4, heads=8, page_size=16, prefixes=[2000])
            with self.assertRaises(VerifydError) as cm:
                ch.verify(**big, compact=False)
            self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            np.testing.assert_array_equal(ch.verify(**bundles[2]).o, want[2].o)
            metrics = self.client_metrics()
            self.assertRegex(metrics, r"(?m)^verifyd_channels [1-9]")
        with self.assertRaises(VerifydError) as cm:
            ch.verify(**bundles[0])
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertRegex(self.client_metrics(), r"(?m)^verifyd_channels 0")

    def client_metrics(self):
        import urllib.request  # noqa: PLC0415
        return urllib.request.urlopen(self.daemon.metrics_url, timeout=5).read().decode()

    def test_health_and_metrics(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("verifyd.v1.VerifyService"), "SERVING")
        b = random_bundle(rng_for(self, 18), batch=1, draft=1, heads=1, page_size=2,
                          prefixes=[0])
        self.client.verify(**b)
        m = re.search(r'^verifyd_requests_total\{(?=[^}]*code="OK")(?=[^}]*path="reference")'
                      r'[^}]*\} (\S+)$', self.daemon.metrics(), re.M)
        self.assertIsNotNone(m)
        self.assertGreaterEqual(float(m.group(1)), 1)

    @unittest.skipUnless(HAVE_TORCH, "torch is not installed")
    def test_torch_tensors_in_and_out(self):
        import torch

        b = random_bundle(rng_for(self, 19), batch=2, draft=3, heads=2, page_size=4,
                          prefixes=[6, 13], unused_pages=5)
        want = self.client.verify(**b, want_lse=True)

        def bf16(a):
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)

        tb = dict(b, q=bf16(b["q"]), kv_pool=bf16(b["kv_pool"]),
                  kv_indptr=torch.from_numpy(b["kv_indptr"]).long(),
                  kv_indices=torch.from_numpy(b["kv_indices"]),
                  kv_lens=torch.from_numpy(b["kv_lens"]),
                  tree_mask=torch.from_numpy(b["tree_mask"]).bool())
        r = self.client.verify(**tb, want_lse=True)
        self.assertEqual(r.o.dtype, torch.bfloat16)
        self.assertEqual(tuple(r.o.shape), (6, 2, 512))
        np.testing.assert_array_equal(r.o.view(torch.int16).numpy().view(np.uint16), want.o)
        np.testing.assert_array_equal(r.lse.numpy(), want.lse)
        with self.assertRaises(InvalidBundleError) as cm:
            self.client.verify(**dict(tb, q=tb["q"].float()))
        self.assertField(cm.exception, "q")


class DeclaredSizeTest(unittest.TestCase):
    """Unary calls declare their request's size in their metadata, so that verifyd admits them to
    its memory budget, or refuses them, before the message arrives."""

    def test_the_key_is_the_daemons(self):
        header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src",
                              "transport", "request_bytes.h")
        with open(header, encoding="utf-8") as f:
            m = re.search(r'kRequestBytesKey\[\] = "([^"]+)"', f.read())
        self.assertIsNotNone(m)
        self.assertEqual(REQUEST_BYTES_KEY, m.group(1))

    def test_the_declared_size_is_the_size_sent(self):
        # A stand-in server that records what each call declared and what it sent.
        seen = []

        def verify(request, context):
            declared = [v for k, v in context.invocation_metadata() if k == REQUEST_BYTES_KEY]
            seen.append((declared, len(request)))
            context.abort(grpc.StatusCode.UNAVAILABLE, "recorded")

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "verifyd.v1.VerifyService", {"Verify": grpc.unary_unary_rpc_method_handler(verify)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            rng = rng_for(self, 21)
            with VerifyClient(f"127.0.0.1:{port}", timeout=30) as client:
                for _ in range(4):
                    b = random_bundle(rng, batch=1, draft=int(rng.integers(1, 6)), heads=2,
                                      page_size=8, prefixes=[int(rng.integers(0, 500))],
                                      unused_pages=int(rng.integers(0, 50)))
                    with self.assertRaises(VerifydError):
                        client.verify(**b, request_id="declared")
        finally:
            server.stop(None)
        self.assertEqual(len(seen), 4)
        for declared, sent in seen:
            self.assertGreater(sent, 0)
            self.assertEqual(declared, [str(sent)])

    def test_an_over_budget_call_is_refused_from_its_declaration(self):
        daemon = Daemon("--max_inflight_mb=1")
        try:
            with VerifyClient(daemon.data, timeout=60) as client:
                b = random_bundle(rng_for(self, 22), batch=1, draft=2, heads=2, page_size=16,
                                  prefixes=[1200])  # about 1.4 MB of pool
                with self.assertRaises(VerifydError) as cm:
                    client.verify(**b)
                self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
                self.assertEqual(cm.exception.field, REQUEST_BYTES_KEY, cm.exception.message)
                self.assertIn("--max_inflight_mb", cm.exception.message)
                small = random_bundle(rng_for(self, 23), batch=1, draft=2, heads=2,
                                      page_size=16, prefixes=[40])
                self.assertEqual(client.verify(**small).o.shape, (2, 2, 512))
        finally:
            daemon.stop()


class ChannelRefusalTest(unittest.TestCase):
    """A channel verifyd refuses to open: the caller sees verifyd's status and message, and the
    shared-memory object the client made for it is gone."""

    @staticmethod
    def shm_objects():
        return {e for e in os.listdir("/dev/shm") if e.startswith("psm_")}

    def test_a_refused_channel_raises_verifyds_error_and_leaves_no_object(self):
        daemon = Daemon("--max_channels_per_client=2")
        try:
            with VerifyClient(daemon.data, timeout=30) as client:
                before = self.shm_objects()
                first, second = client.channel(byte_size=1 << 20), client.channel(byte_size=1 << 20)
                # An open channel's object has no name (both sides map it), so that a client
                # that dies leaves nothing behind.
                self.assertEqual(self.shm_objects() - before, set())
                for _ in range(3):
                    with self.assertRaises(VerifydError) as cm:
                        client.channel(byte_size=1 << 20)
                    self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
                    self.assertIn("--max_channels_per_client", str(cm.exception))
                    self.assertEqual(self.shm_objects() - before, set())
                # A size the client refuses itself leaves nothing either.
                second.close()
                with self.assertRaises(ValueError):
                    client.channel(byte_size=16)
                self.assertEqual(self.shm_objects() - before, set())
                b = random_bundle(rng_for(self, 23), batch=1, draft=2, heads=2, page_size=4,
                                  prefixes=[9])
                first.verify(**b)
                first.close()
                self.assertEqual(self.shm_objects() - before, set())
        finally:
            daemon.stop()


class AdminTest(unittest.TestCase):
    """Admin service over its unix socket: status, the gate, forced flips, rollback."""

    def setUp(self):
        self.daemon = Daemon("--gate_window=2")
        self.admin = AdminClient(self.daemon.admin)
        self.client = VerifyClient(self.daemon.data, timeout=60)

    def tearDown(self):
        self.client.close()
        self.admin.close()
        self.daemon.stop()

    def test_status_flip_force_and_rollback(self):
        s = self.admin.status()
        self.assertEqual(s["mode"], "shadow")
        self.assertEqual(s["engine"]["engine"], "cpu")
        self.assertFalse(s["gate"]["ready"])
        with self.assertRaises(VerifydError) as cm:
            self.admin.flip("custom", reason="no comparisons yet")
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(ValueError):
            self.admin.flip("canary", reason="a fraction past 1", fraction=1.5)
        with self.assertRaises(ValueError):
            self.admin.flip("custom", reason="a fraction for custom", fraction=0.3, force=True)
        self.assertEqual(s["runtime"]["inject_custom_fault"], "")
        # The sections verifyctl status shows are all here, named as in its --json.
        for section in ("probe", "drift", "channels", "capture", "counters", "recent"):
            self.assertIn(section, s)
        self.assertEqual(s["channels"], [])
        self.assertEqual(s["comparisons_since_mode_change"], 0)
        self.assertEqual(s["regions"], [])
        self.assertEqual(s["runtime"]["listen"], [self.daemon.data])

        r = self.admin.flip("custom", reason="python test", force=True, who="test@ci")
        self.assertEqual((r["mode"], r["forced"]), ("custom", True))
        b = random_bundle(rng_for(self, 21), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[7])
        self.assertEqual(self.client.verify(**b).served_path, "custom")
        s = self.admin.status()
        self.assertEqual(s["mode"], "custom")
        last = s["audit"][-1]
        self.assertEqual((last["from"], last["to"], last["forced"], last["who"], last["reason"]),
                         ("shadow", "custom", True, "test@ci", "python test"))
        self.assertTrue(last["peer"].startswith(f"uid:{os.getuid()}"), last["peer"])

        self.assertEqual(self.admin.rollback(reason="python test done")["mode"], "shadow")
        self.assertEqual(self.client.verify(**b).served_path, "reference")
        self.assertEqual(self.admin.status()["audit"][-1]["reason"], "python test done")

    def test_flip_passes_the_gate_after_clean_comparisons(self):
        b = random_bundle(rng_for(self, 22), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[7])
        for _ in range(2):
            self.assertTrue(self.client.verify(**b, compare_sync=True).comparison["match"])
        self.assertTrue(self.admin.status()["gate"]["ready"])
        r = self.admin.flip("canary", reason="gate is clean", fraction=0.5)
        self.assertEqual(r, {"mode": "canary", "canary_fraction": 0.5, "forced": False})
        self.assertEqual(self.admin.status()["comparisons_since_mode_change"], 0)
        self.admin.rollback(reason="again, at the persisted fraction")
        r = self.admin.flip("canary", reason="no fraction given", force=True)
        self.assertEqual(r["canary_fraction"], 0.5)

    def test_run_probes(self):
        r = self.admin.run_probes()
        self.assertTrue(r["passed"], r["summary"])
        self.assertGreater(len(r["results"]), 5)
        self.assertTrue(all(p["passed"] for p in r["results"]))
        self.assertEqual(self.admin.status()["probe"]["runs"], 1)


if __name__ == "__main__":
    unittest.main()
