"""verifyd_client's shm transport against the real verifyd (CPU engine) on a Unix socket:
registered regions, staging slots, o written into shared memory, errors, cleanup; and the
SGLang target-verify adapter against an independent implementation.

Seeds are fixed per test and printed; run through run_tests.py, which finds the binary.
"""

import importlib.util
import os
import time
import unittest

import grpc
import numpy as np

from random_bundles import BF16_NAN, oracle, random_bundle, rel_l2
from sglang_reference import extend_attention_numpy, random_target_verify
from verifyd_client import (InvalidBundleError, VerifyClient, VerifydError, from_bf16,
                            from_e4m3, pack_mask, sglang_target_verify, to_e4m3)
from verifyd_client.sglang import target_verify_call
from verifyd_daemon import Daemon

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SCALE = 1.0 / np.sqrt(192.0)


def rng_for(test, seed):
    print(f"\n  {test.id().rsplit('.', 1)[-1]}: seed {seed}")
    return np.random.default_rng(seed)


def shm_exists(key):
    return os.path.exists("/dev/shm/" + key.lstrip("/"))


def send(client, req):
    """A prepared request through the client's channel, errors as VerifydError."""
    try:
        return client._stub.Verify(req, timeout=60)  # noqa: SLF001 - the raw call
    except grpc.RpcError as e:
        raise VerifydError.from_rpc_error(e) from None


class ShmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.inline = VerifyClient(cls.daemon.data, timeout=60)
        cls.shm = VerifyClient(cls.daemon.data, timeout=60, transport="shm")

    @classmethod
    def tearDownClass(cls):
        cls.shm.close()
        cls.inline.close()
        cls.daemon.stop()

    def mine(self, client):
        return [r for r in self.inline.list_regions() if r["client"] == client.client_id]

    def assertSame(self, got, want):
        np.testing.assert_array_equal(got.o, want.o)
        if want.lse is None:
            self.assertIsNone(got.lse)
        else:
            np.testing.assert_array_equal(got.lse, want.lse)

    def test_equals_inline_bit_for_bit(self):
        rng = rng_for(self, 31)
        shapes = [dict(batch=1, draft=1, heads=1, page_size=1, prefixes=[0]),
                  dict(batch=2, draft=5, heads=3, page_size=16, prefixes=[37, 0]),
                  dict(batch=3, draft=17, heads=4, page_size=64, prefixes=[97, 1, 54],
                       unused_pages=5, spare_pages=1, share_first_page=True),
                  dict(batch=2, draft=3, heads=2, page_size=1, prefixes=[54, 1],
                       unused_pages=300)]
        for i, shape in enumerate(shapes):
            b = random_bundle(rng, **shape)
            for want_lse in (False, True):
                for compact in (True, False):
                    with self.subTest(case=i, want_lse=want_lse, compact=compact):
                        want = self.inline.verify(**b, want_lse=want_lse)
                        got = self.shm.verify(**b, want_lse=want_lse, compact=compact,
                                              request_id=f"shm-{i}")
                        self.assertSame(got, want)
                        self.assertEqual((got.served_path, got.request_id),
                                         ("reference", f"shm-{i}"))
        packed = dict(b, tree_mask=pack_mask(b["tree_mask"]))
        self.assertSame(self.shm.verify(**packed), self.inline.verify(**b))
        o = from_bf16(self.shm.verify(**b).o).astype(np.float64)
        self.assertLess(rel_l2(o, oracle(b)[0]), 1e-2)

    def test_o_is_written_into_shared_memory(self):
        b = random_bundle(rng_for(self, 32), batch=2, draft=4, heads=2, page_size=8,
                          prefixes=[11, 30])
        want = self.inline.verify(**b, want_lse=True)
        transport = self.shm._transport  # noqa: SLF001 - the request as sent, the slot it used
        req, pending = transport.encode(b["q"], b["kv_pool"], b["kv_indptr"], b["kv_indices"],
                                        b["kv_lens"], b["tree_mask"], b["sm_scale"], True, "",
                                        True, None, False, None)
        try:
            for name in ("q", "kv_pool", "kv_indptr", "kv_indices", "kv_lens", "tree_mask",
                         "o_out", "lse_out"):
                self.assertEqual(getattr(req, name).WhichOneof("contents"), "shm", name)
            resp = send(self.shm, req)
            self.assertEqual(resp.o.raw_contents, b"")
            self.assertEqual(resp.lse.raw_contents, b"")
            slot = pending._slot  # noqa: SLF001
            o = slot.array(req.o_out.shm.offset, np.uint16, want.o.shape)
            lse = slot.array(req.lse_out.shm.offset, np.float32, want.lse.shape)
            np.testing.assert_array_equal(o, want.o)
            np.testing.assert_array_equal(lse, want.lse)
        finally:
            pending.release()

    def test_registered_pool_is_named_in_place(self):
        rng = rng_for(self, 33)
        b = random_bundle(rng, batch=2, draft=3, heads=2, page_size=4, prefixes=[9, 21],
                          unused_pages=40)
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            pool = c.register_kv_pool(b["kv_pool"])
            self.assertFalse(np.shares_memory(pool, b["kv_pool"]))
            before = {r["name"]: r for r in self.mine(c)}
            self.assertEqual(len(before), 1)
            (pool_region,) = before.values()
            self.assertEqual(pool_region["byte_size"], b["kv_pool"].nbytes)
            self.assertEqual(pool_region["kind"], "shm")
            self.assertSame(c.verify(**dict(b, kv_pool=pool), want_lse=True),
                            self.inline.verify(**b, want_lse=True))
            after = {r["name"]: r for r in self.mine(c)}
            self.assertEqual(after[pool_region["name"]]["calls"], 1)
            # New pages written in place are what the next call reads.
            fresh = random_bundle(rng, batch=2, draft=3, heads=2, page_size=4, prefixes=[9, 21],
                                  unused_pages=40)
            self.assertEqual(fresh["kv_pool"].shape, pool.shape)
            pool[...] = fresh["kv_pool"]
            self.assertSame(c.verify(**dict(fresh, kv_pool=pool)), self.inline.verify(**fresh))
            # A pool allocated in the client's shared memory and filled there.
            direct = c.shm_array(b["kv_pool"].shape)
            direct[...] = b["kv_pool"]
            self.assertSame(c.verify(**dict(b, kv_pool=direct)), self.inline.verify(**b))

    def test_arrays_off_the_offset_grid_are_staged(self):
        # verifyd refuses region offsets that are not multiples of 16; arrays in the client's
        # shared memory that start off that grid are copied into a slot instead.
        rng = rng_for(self, 34)
        b = random_bundle(rng, batch=2, draft=3, heads=2, page_size=4, prefixes=[9, 21])
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            pool_flat = c.shm_array((b["kv_pool"].size + 1,))
            q_flat = c.shm_array((b["q"].size + 4,))
            pool = pool_flat[1:].reshape(b["kv_pool"].shape)  # 2 bytes in
            q = q_flat[4:].reshape(b["q"].shape)  # 8 bytes in
            pool[...] = b["kv_pool"]
            q[...] = b["q"]
            self.assertSame(c.verify(**dict(b, kv_pool=pool, q=q), want_lse=True),
                            self.inline.verify(**b, want_lse=True))
            calls = {r["name"]: r["calls"] for r in self.mine(c)}
            arrays = [n for n in calls if "/array" in n]
            self.assertEqual(len(arrays), 2)
            self.assertEqual([calls[n] for n in arrays], [0, 0])  # neither was named in place

    @unittest.skipUnless(HAVE_TORCH, "torch is not installed")
    def test_torch_cpu_tensors(self):
        import torch

        b = random_bundle(rng_for(self, 34), batch=2, draft=3, heads=2, page_size=4,
                          prefixes=[6, 13], unused_pages=5)
        want = self.inline.verify(**b, want_lse=True)

        def bf16(a):
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)

        tb = dict(b, q=bf16(b["q"]), kv_pool=bf16(b["kv_pool"]))
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            r = c.verify(**tb, want_lse=True)
            self.assertEqual(r.o.dtype, torch.bfloat16)
            np.testing.assert_array_equal(r.o.view(torch.int16).numpy().view(np.uint16), want.o)
            pool = c.register_kv_pool(tb["kv_pool"])
            self.assertEqual(pool.dtype, torch.bfloat16)
            r = c.verify(**dict(tb, kv_pool=pool))
            np.testing.assert_array_equal(r.o.view(torch.int16).numpy().view(np.uint16), want.o)

    def test_stream_calls_in_flight_use_their_own_slots(self):
        rng = rng_for(self, 35)
        bundles = [random_bundle(rng, batch=1 + i % 3, draft=2 + i, heads=2, page_size=8,
                                 prefixes=[5 * i + 1] * (1 + i % 3)) for i in range(6)]
        want = [self.inline.verify(**b, want_lse=True) for b in bundles]
        with VerifyClient(self.daemon.data, timeout=60, transport="shm",
                          staging_slots=6) as c:
            with c.stream() as s:
                for i, b in enumerate(bundles):
                    s.send(**b, want_lse=True, request_id=f"p{i}")
                for i in range(len(bundles)):
                    r = s.recv()
                    self.assertEqual(r.request_id, f"p{i}")
                    self.assertSame(r, want[i])
                # An error answer gives its slot back and leaves the stream open.
                with self.assertRaises(VerifydError) as cm:
                    s.verify(**bundles[0], device=5)
                self.assertEqual(cm.exception.field, "device")
                self.assertSame(s.verify(**bundles[2], want_lse=True), want[2])
            self.assertEqual(c._transport._ring.held(), 0)  # noqa: SLF001
            slots = [r for r in self.mine(c) if "/slot" in r["name"]]
            self.assertEqual(len(slots), 6)

    def test_too_many_calls_in_flight(self):
        b = random_bundle(rng_for(self, 36), batch=1, draft=2, heads=1, page_size=4,
                          prefixes=[3])
        want = self.inline.verify(**b)
        with VerifyClient(self.daemon.data, timeout=60, transport="shm",
                          staging_slots=2) as c, c.stream() as s:
            s.send(**b)
            s.send(**b)
            with self.assertRaisesRegex(RuntimeError, "staging_slots"):
                s.send(**b)
            self.assertSame(s.recv(), want)
            s.send(**b)
            self.assertSame(s.recv(), want)
            self.assertSame(s.recv(), want)

    def test_a_cancelled_stream_retires_its_slots(self):
        b = random_bundle(rng_for(self, 45), batch=2, draft=4, heads=4, page_size=16,
                          prefixes=[300, 100])
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            s = c.stream()
            s.send(**b)
            s.send(**b)
            self.assertEqual(len(self.mine(c)), 2)
            s.cancel()
            # verifyd may still run those calls: their slots are unregistered, never reused.
            self.assertEqual(self.mine(c), [])
            self.assertEqual(c._transport._ring.held(), 0)  # noqa: SLF001
            self.assertSame(c.verify(**b), self.inline.verify(**b))

    def test_slots_grow_for_larger_calls(self):
        rng = rng_for(self, 37)
        small = random_bundle(rng, batch=1, draft=2, heads=1, page_size=1, prefixes=[2])
        large = random_bundle(rng, batch=4, draft=16, heads=16, page_size=16,
                              prefixes=[400, 300, 200, 100])
        with VerifyClient(self.daemon.data, timeout=60, transport="shm",
                          staging_slots=1) as c:
            self.assertSame(c.verify(**small), self.inline.verify(**small))
            first = [r["byte_size"] for r in self.mine(c)]
            self.assertSame(c.verify(**large, want_lse=True),
                            self.inline.verify(**large, want_lse=True))
            second = [r["byte_size"] for r in self.mine(c)]
            self.assertEqual(len(second), 1)
            self.assertGreater(second[0], first[0])
            self.assertSame(c.verify(**small), self.inline.verify(**small))

    def test_a_call_past_its_deadline_retires_its_slot(self):
        rng = rng_for(self, 44)
        small = random_bundle(rng, batch=1, draft=2, heads=1, page_size=4, prefixes=[3])
        large = random_bundle(rng, batch=2, draft=8, heads=8, page_size=16,
                              prefixes=[500, 300])
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            c.verify(**large)
            (slot,) = self.mine(c)  # the slot the next call uses too
            c.timeout = 1e-4
            with self.assertRaises(VerifydError) as cm:
                c.verify(**large)
            self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            # verifyd may still be reading the slot: it is unregistered, never reused.
            self.assertEqual(self.mine(c), [])
            self.assertFalse(shm_exists(slot["shm_key"]))
            c.timeout = 60
            self.assertSame(c.verify(**small), self.inline.verify(**small))
            self.assertNotEqual([r["name"] for r in self.mine(c)], [slot["name"]])

    def test_shadow_work_is_safe_from_inputs_changed_after_the_answer(self):
        from verifyd_client import AdminClient

        rng = rng_for(self, 46)
        shape = dict(batch=2, draft=4, heads=4, page_size=16, prefixes=[200, 90],
                     unused_pages=8)
        calls = 8
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c, \
                AdminClient(self.daemon.admin) as admin:
            status = admin.status()
            admin.set_sampling("shadow", 1.0, "test: compare every call")
            try:
                before = admin.status()["counters"]
                b0 = random_bundle(rng, **shape)
                pool = c.register_kv_pool(b0["kv_pool"])
                q = c.shm_array(b0["q"].shape)
                for k in range(calls):
                    b = b0 if k == 0 else random_bundle(rng, **shape)
                    pool[...] = b["kv_pool"]
                    q[...] = b["q"]
                    r = c.verify(**dict(b, q=q, kv_pool=pool))
                    self.assertEqual(r.mode, "shadow")
                    # Right after the answer, the pages it read and q change to garbage.
                    pool[b["kv_indices"]] = BF16_NAN
                    q[...] = BF16_NAN
                    self.assertFalse(np.isnan(from_bf16(r.o)).any())
                deadline = time.monotonic() + 60
                keys = ("comparisons_match", "comparisons_breach", "comparisons_error",
                        "comparisons_skipped")
                while True:
                    after = admin.status()["counters"]
                    delta = {k: after[k] - before[k] for k in keys}
                    if sum(delta.values()) >= calls or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                print(f"  comparisons: {delta}")
                self.assertEqual(delta["comparisons_match"], calls, delta)
                self.assertEqual(delta["comparisons_breach"], 0, delta)
            finally:
                admin.set_sampling("shadow", status["shadow_sample_rate"], "test: restore the rate")

    def assertField(self, err, code, field):
        self.assertEqual(err.code, code, err)
        self.assertNotIsInstance(err, InvalidBundleError)
        self.assertEqual(err.field, field, err)

    def test_bad_refs_are_refused_naming_the_field(self):
        b = random_bundle(rng_for(self, 38), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[5])
        transport = self.shm._transport  # noqa: SLF001 - requests with refs made bad
        args = (b["q"], b["kv_pool"], b["kv_indptr"], b["kv_indices"], b["kv_lens"],
                b["tree_mask"], b["sm_scale"], False, "", True, None, False, None)

        def refused(mutate):
            req, pending = transport.encode(*args)
            try:
                mutate(req)
                with self.assertRaises(VerifydError) as cm:
                    send(self.shm, req)
                return cm.exception
            finally:
                pending.release()

        def unknown(req):
            req.q.shm.region = "no-such-region"

        def past_end(req):
            req.kv_indices.shm.offset = 1 << 40

        def size_mismatch(req):
            req.kv_pool.shm.byte_size -= 2

        def o_shape(req):
            req.o_out.shape[0] += 1
            req.o_out.shm.byte_size += 2 * 512 * req.o_out.shape[1]

        self.assertField(refused(unknown), grpc.StatusCode.NOT_FOUND, "q")
        self.assertField(refused(past_end), grpc.StatusCode.INVALID_ARGUMENT, "kv_indices")
        self.assertField(refused(size_mismatch), grpc.StatusCode.INVALID_ARGUMENT, "kv_pool")
        self.assertField(refused(o_shape), grpc.StatusCode.INVALID_ARGUMENT, "o_out")
        # The daemon keeps serving.
        self.assertSame(self.shm.verify(**b), self.inline.verify(**b))

    def test_region_set_of_layer_pools(self):
        """A process's per-layer KV pools registered as one region set; a call names its layer
        by index and gets the inline call's output."""
        from multiprocessing import shared_memory

        from verifyd_client import regions
        from verifyd_client._proto import types_pb2

        rng = rng_for(self, 49)
        layers = [random_bundle(rng, batch=2, draft=3, heads=2, page_size=4, prefixes=[9, 21],
                                unused_pages=3 + i) for i in range(5)]
        objs = []
        try:
            for b in layers:
                shm = shared_memory.SharedMemory(create=True, size=b["kv_pool"].nbytes)
                objs.append(shm)
                np.ndarray(b["kv_pool"].shape, b["kv_pool"].dtype, buffer=shm.buf)[...] = \
                    b["kv_pool"]
            with VerifyClient(self.daemon.data, timeout=60) as c:
                name = c.client_id + "/layers"
                info = c.register_shm_set(name, objs)
                self.assertEqual(info["members"], 5)
                self.assertEqual(info["byte_size"], sum(b["kv_pool"].nbytes for b in layers))
                self.assertEqual(info["owner"], f"uid {os.getuid()} pid {os.getpid()}")
                self.assertIn(name, [s["name"] for s in c.list_region_sets()])
                self.assertFalse([r for r in c.list_regions() if r["client"] == c.client_id])

                def call(i, index):
                    b = layers[i]
                    req, pending = c._transport.encode(  # noqa: SLF001 - kv_pool swapped below
                        b["q"], b["kv_pool"], b["kv_indptr"], b["kv_indices"], b["kv_lens"],
                        b["tree_mask"], b["sm_scale"], False, "", False, None, False, None)
                    req.kv_pool.CopyFrom(regions.set_ref(name, index, 0, types_pb2.DTYPE_BF16,
                                                         b["kv_pool"].shape))
                    return pending.decode(send(c, req))

                for i in (0, 3, 4):
                    got = call(i, i)
                    self.assertSame(got, self.inline.verify(**layers[i]))
                    self.assertLess(rel_l2(from_bf16(got.o).astype(np.float64),
                                           oracle(layers[i])[0]), 1e-2)
                with self.assertRaises(VerifydError) as cm:
                    call(0, 5)
                self.assertField(cm.exception, grpc.StatusCode.INVALID_ARGUMENT, "kv_pool")
                self.assertIn("index 5 is out of range", cm.exception.message)
                self.assertSame(call(1, 1), self.inline.verify(**layers[1]))  # still serving
            # close() unregistered the set.
            self.assertNotIn(name, [s["name"] for s in self.inline.list_region_sets()])
        finally:
            for shm in objs:
                shm.close()
                shm.unlink()

    def test_region_calls_raise_the_daemons_errors(self):
        calls = self.shm._regions  # noqa: SLF001
        with self.assertRaises(VerifydError) as cm:
            calls.register_shm("py-missing", "/verifyd-py-no-such-object", 0, 4096, "t")
        self.assertField(cm.exception, grpc.StatusCode.NOT_FOUND, "key")
        with self.assertRaises(VerifydError) as cm:
            calls.register_shm("py-badkey", "no-slash", 0, 4096, "t")
        self.assertField(cm.exception, grpc.StatusCode.INVALID_ARGUMENT, "key")
        with self.assertRaises(VerifydError) as cm:
            calls.unregister(name="py-never-registered")
        self.assertField(cm.exception, grpc.StatusCode.NOT_FOUND, "name")
        # The CPU engine opens no CUDA IPC handles; a handle of the wrong size is refused first.
        with self.assertRaises(VerifydError) as cm:
            calls.register_cuda("py-cuda", b"\0" * 66, 0, 4096, "t")
        self.assertField(cm.exception, grpc.StatusCode.INVALID_ARGUMENT, "ipc_handle")
        with self.assertRaises(VerifydError) as cm:
            calls.register_cuda("py-cuda", b"\0" * 64, 0, 4096, "t")
        self.assertField(cm.exception, grpc.StatusCode.FAILED_PRECONDITION, "ipc_handle")

    def test_unregistered_pool_is_not_found(self):
        b = random_bundle(rng_for(self, 39), batch=1, draft=2, heads=2, page_size=4,
                          prefixes=[5])
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c:
            pool = c.register_kv_pool(b["kv_pool"])
            c.verify(**dict(b, kv_pool=pool))
            (pool_region,) = [r["name"] for r in self.mine(c) if "/array" in r["name"]]
            self.inline._regions.unregister(name=pool_region)  # noqa: SLF001
            with self.assertRaises(VerifydError) as cm:
                c.verify(**dict(b, kv_pool=pool))
            self.assertField(cm.exception, grpc.StatusCode.NOT_FOUND, "kv_pool")
            # Another process clears a client's regions (as after a crash) by its client id.
            self.assertEqual(len(self.inline.unregister_regions(c.client_id)), 1)  # the slot
            self.assertEqual(self.mine(c), [])

    def test_close_unregisters_and_unlinks(self):
        b = random_bundle(rng_for(self, 40), batch=2, draft=3, heads=2, page_size=4,
                          prefixes=[5, 8])
        c = VerifyClient(self.daemon.data, timeout=60, transport="shm")
        pool = c.register_kv_pool(b["kv_pool"])
        with c.stream() as s:
            s.verify(**dict(b, kv_pool=pool))
        c.verify(**b)
        regions = self.mine(c)
        self.assertEqual(len(regions), 2)
        keys = [r["shm_key"] for r in regions]
        self.assertTrue(all(shm_exists(k) for k in keys), keys)
        c.close()
        self.assertEqual(self.mine(c), [])
        self.assertFalse(any(shm_exists(k) for k in keys), keys)
        c.close()  # twice is fine
        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c2:
            c2.verify(**b)
            keys = [r["shm_key"] for r in self.mine(c2)]
            self.assertEqual(len(keys), 1)
        self.assertEqual(self.mine(c2), [])
        self.assertFalse(any(shm_exists(k) for k in keys), keys)

    def test_admin_status_lists_regions(self):
        from verifyd_client import AdminClient

        with VerifyClient(self.daemon.data, timeout=60, transport="shm") as c, \
                AdminClient(self.daemon.admin) as admin:
            c.shm_array((4, 1, 576))
            regions = [r for r in admin.status()["regions"] if r["client"] == c.client_id]
            self.assertEqual([(r["kind"], r["byte_size"]) for r in regions],
                             [("shm", 4 * 576 * 2)])

    def test_regions_are_refused_over_tcp(self):
        b = random_bundle(rng_for(self, 47), batch=1, draft=2, heads=1, page_size=4,
                          prefixes=[3])
        for allow in (False, True):
            with self.subTest(allow_region_tcp=allow):
                flags = ("--allow_region_tcp",) if allow else ()
                daemon = Daemon(*flags, tcp=True)
                try:
                    with VerifyClient(daemon.data_tcp, timeout=60, transport="shm") as c:
                        if allow:
                            self.assertSame(c.verify(**b), self.inline.verify(**b))
                            continue
                        with self.assertRaises(VerifydError) as cm:
                            c.verify(**b)
                        self.assertField(cm.exception, grpc.StatusCode.PERMISSION_DENIED,
                                         "RegisterShmRegion")
                        self.assertIn("--listen=unix:PATH", cm.exception.message)
                        self.assertNotIn("--allow_region_tcp", cm.exception.message)
                        # Nothing was registered, nothing is left behind.
                        self.assertEqual(c._transport._ring.held(), 0)  # noqa: SLF001
                finally:
                    daemon.stop()

    def test_inline_and_cuda_ipc_refuse_what_they_cannot_do(self):
        with self.assertRaises(ValueError):
            self.inline.register_kv_pool(np.zeros((1, 1, 576), np.uint16))
        with self.assertRaises(ValueError):
            self.inline.shm_array((2, 2))
        with self.assertRaises(ValueError):
            VerifyClient(self.daemon.data, transport="carrier-pigeon")
        if not HAVE_TORCH:
            with self.assertRaisesRegex(ImportError, "torch"):
                VerifyClient(self.daemon.data, transport="cuda_ipc")


class SglangAdapterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.inline = VerifyClient(cls.daemon.data, timeout=60)
        cls.shm = VerifyClient(cls.daemon.data, timeout=60, transport="shm")

    @classmethod
    def tearDownClass(cls):
        cls.shm.close()
        cls.inline.close()
        cls.daemon.stop()

    def test_matches_an_independent_implementation(self):
        rng = rng_for(self, 41)
        for batch, draft, heads, prefixes in ((1, 1, 1, [0]), (2, 5, 3, [37, 1]),
                                              (3, 17, 2, [97, 0, 54])):
            with self.subTest(batch=batch, draft=draft):
                call = random_target_verify(rng, batch, draft, heads, prefixes)
                r = sglang_target_verify(self.inline, **call, sm_scale=SCALE, want_lse=True)
                want_o, want_lse = extend_attention_numpy(call, SCALE)
                self.assertEqual(r.o.shape, (batch * draft, heads, 512))
                self.assertLess(rel_l2(from_bf16(r.o).astype(np.float64), want_o), 1e-2)
                np.testing.assert_allclose(r.lse, want_lse, atol=1e-3, rtol=1e-4)
                # The pool registered once in shared memory: the same bits.
                pool = self.shm.register_kv_pool(call["k_buffer"])
                r2 = sglang_target_verify(self.shm, **dict(call, k_buffer=pool),
                                          sm_scale=SCALE, want_lse=True)
                np.testing.assert_array_equal(r2.o, r.o)
                np.testing.assert_array_equal(r2.lse, r.lse)
                flat = dict(call, k_buffer=call["k_buffer"].reshape(-1, 576))
                np.testing.assert_array_equal(
                    sglang_target_verify(self.inline, **flat, sm_scale=SCALE).o, r.o)

    def test_an_e4m3_pool_with_its_k_scale(self):
        """An e4m3 k_buffer (uint8 bits) with k_scale = v_scale: the backend's reading of
        e4m3 x k_scale; a scale verifyd cannot take is refused naming it."""
        call = random_target_verify(rng_for(self, 44), 2, 5, 3, [37, 1])
        kv = 0.37
        fp8 = to_e4m3(from_bf16(call["k_buffer"]) / np.float32(kv))
        r = sglang_target_verify(self.inline, **dict(call, k_buffer=fp8), sm_scale=SCALE,
                                 k_scale=kv, v_scale=kv, want_lse=True)
        want_o, want_lse = extend_attention_numpy(dict(call, k_buffer=from_e4m3(fp8, kv)), SCALE)
        self.assertLess(rel_l2(from_bf16(r.o).astype(np.float64), want_o), 1e-2)
        np.testing.assert_allclose(r.lse, want_lse, atol=1e-3, rtol=1e-4)
        for kw, field in (({"k_scale": kv, "v_scale": 0.5}, "v_scale"),
                          ({"k_scale": None, "v_scale": None}, "k_scale"),
                          ({"k_scale": 0.0, "v_scale": 0.0}, "k_scale")):
            with self.assertRaisesRegex(ValueError, f"^{field}: "):
                sglang_target_verify(self.inline, **dict(call, k_buffer=fp8), sm_scale=SCALE,
                                     **kw)
        with self.assertRaisesRegex(ValueError, "^k_scale: .*bf16 pool"):
            sglang_target_verify(self.inline, **call, sm_scale=SCALE, k_scale=kv, v_scale=kv)

    def test_conversion(self):
        call = random_target_verify(rng_for(self, 42), 2, 3, 1, [4, 2])
        v = target_verify_call(**{k: call[k] for k in call if k != "qo_indptr"})
        np.testing.assert_array_equal(v["kv_lens"], [7, 5])
        np.testing.assert_array_equal(v["kv_indptr"], [0, 7, 12])
        np.testing.assert_array_equal(
            v["kv_indices"], np.concatenate([call["kv_indices"][:4], call["out_cache_loc"][:3],
                                             call["kv_indices"][4:], call["out_cache_loc"][3:]]))
        block1 = call["custom_mask"][call["mask_indptr"][1]:].reshape(3, 5)
        np.testing.assert_array_equal(v["tree_mask"][1], block1[:, 2:])
        self.assertEqual(v["kv_pool"].shape, (call["k_buffer"].shape[0], 1, 576))

    def test_bad_arguments_name_the_field(self):
        call = random_target_verify(rng_for(self, 43), 2, 3, 1, [4, 2])
        bad_mptr = call["mask_indptr"].copy()
        bad_mptr[1] -= 1
        masked_prefix = call["custom_mask"].copy()
        masked_prefix[0] = False
        cases = {
            "mask_indptr[1]": dict(call, mask_indptr=bad_mptr),
            "out_cache_loc": dict(call, out_cache_loc=call["out_cache_loc"][:-1]),
            "qo_indptr": dict(call, qo_indptr=np.array([0, 2, 6])),
            "q": dict(call, q=call["q"][:-1]),
            "k_buffer": dict(call, k_buffer=call["k_buffer"][:10].reshape(5, 2, 576)),
        }
        for field, bad in cases.items():
            with self.subTest(field=field):
                with self.assertRaises(InvalidBundleError) as cm:
                    sglang_target_verify(self.inline, **bad, sm_scale=SCALE)
                self.assertEqual(cm.exception.field, field, cm.exception)
        # A masked prefix column: ignored as the backend ignores it by default, refused when
        # the mask's prefix columns are meant to be read.
        ok = sglang_target_verify(self.inline, **dict(call, custom_mask=masked_prefix),
                                  sm_scale=SCALE)
        np.testing.assert_array_equal(ok.o, sglang_target_verify(self.inline, **call,
                                                                 sm_scale=SCALE).o)
        with self.assertRaises(InvalidBundleError) as cm:
            sglang_target_verify(self.inline, **dict(call, custom_mask=masked_prefix),
                                 sm_scale=SCALE, skip_prefix_custom_mask=False)
        self.assertEqual(cm.exception.field, "custom_mask")


if __name__ == "__main__":
    unittest.main()
