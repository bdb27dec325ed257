"""e4m3 KV pools through verifyd_client and the real verifyd (CPU engine): inline and shm, against
the fp64 oracle of the e4m3 values and, at scale 1, bit for bit against the same values sent as a
bf16 pool; the checks of kv_scale in the client and in the daemon, which keeps serving.

Seeds are fixed per test and printed; run through run_tests.py, which finds the binary.
"""

import importlib.util
import math
import unittest

import grpc
import numpy as np

from random_bundles import oracle, random_bundle, rel_l2
from verifyd_client import (InvalidBundleError, VerifyClient, VerifydError, from_bf16, from_e4m3,
                            make_bundle, to_bf16, to_e4m3)
from verifyd_daemon import Daemon

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def rng_for(test, seed):
    print(f"\n  {test.id().rsplit('.', 1)[-1]}: seed {seed}")
    return np.random.default_rng(seed)


def quantised(bundle, scale):
    """The bundle with its pool in e4m3 at ``scale`` (NaN slots stay NaN)."""
    b = dict(bundle)
    b["kv_pool"] = to_e4m3(from_bf16(bundle["kv_pool"]) / np.float32(scale))
    b["kv_scale"] = scale
    return b


SHAPES = [dict(batch=1, draft=1, heads=1, page_size=1, prefixes=[0]),
          dict(batch=2, draft=5, heads=3, page_size=16, prefixes=[37, 0], unused_pages=3),
          dict(batch=3, draft=9, heads=4, page_size=64, prefixes=[97, 1, 54], spare_pages=1)]


class Fp8PoolTest(unittest.TestCase):
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

    def test_matches_the_oracle_of_the_e4m3_values(self):
        rng = rng_for(self, 801)
        for i, shape in enumerate(SHAPES):
            for scale in (1.0, 0.4, 2.5):
                b = quantised(random_bundle(rng, **shape), scale)
                want_o, want_lse = oracle(b)
                for name, client in (("inline", self.inline), ("shm", self.shm)):
                    with self.subTest(case=i, scale=scale, transport=name):
                        got = client.verify(**b, want_lse=True)
                        self.assertLess(rel_l2(from_bf16(got.o).astype(np.float64), want_o),
                                        4e-3)
                        # The scale goes onto the logits in fp32: lse to fp32 rounding.
                        np.testing.assert_allclose(got.lse, want_lse, atol=1e-4)

    def test_an_e4m3_pool_registers_in_shared_memory(self):
        # register_kv_pool copies an e4m3 pool into shared memory as it is (uint8 bits); calls
        # naming it get inline's output bit for bit, and a page written into it in place is read.
        rng = rng_for(self, 806)
        b = quantised(random_bundle(rng, **SHAPES[2]), 0.4)
        pool = self.shm.register_kv_pool(b["kv_pool"])
        self.assertEqual(pool.dtype, np.uint8)
        self.assertEqual(pool.shape, b["kv_pool"].shape)
        want = self.inline.verify(**b, want_lse=True)
        got = self.shm.verify(**dict(b, kv_pool=pool), want_lse=True)
        np.testing.assert_array_equal(got.o, want.o)
        np.testing.assert_array_equal(got.lse, want.lse)
        page = int(b["kv_indices"][0])
        pool[page] = to_e4m3(rng.standard_normal(pool[page].shape).astype(np.float32))
        changed = dict(b, kv_pool=np.array(pool))
        np.testing.assert_array_equal(self.shm.verify(**dict(b, kv_pool=pool)).o,
                                      self.inline.verify(**changed).o)

    def test_the_scale_is_applied(self):
        rng = rng_for(self, 802)
        b = quantised(random_bundle(rng, **SHAPES[1]), 0.25)
        at_one = dict(b, kv_scale=None)
        want_o, _ = oracle(b)
        wrong_o, _ = oracle(dict(b, kv_scale=1.0))
        self.assertGreater(rel_l2(wrong_o, want_o), 0.05)  # the scale matters on this bundle
        got = from_bf16(self.inline.verify(**b).o).astype(np.float64)
        got_at_one = from_bf16(self.inline.verify(**at_one).o).astype(np.float64)
        self.assertLess(rel_l2(got, want_o), 4e-3)
        self.assertLess(rel_l2(got_at_one, wrong_o), 4e-3)

    def test_at_scale_one_equals_the_same_values_in_bf16(self):
        # Every e4m3 value is exact in bf16: the served output is the very same bits.
        rng = rng_for(self, 803)
        for i, shape in enumerate(SHAPES):
            with self.subTest(case=i):
                b = quantised(random_bundle(rng, **shape), 1.0)
                as_bf16 = dict(b, kv_scale=None, kv_pool=to_bf16(from_e4m3(b["kv_pool"])))
                got = self.inline.verify(**b, want_lse=True)
                want = self.inline.verify(**as_bf16, want_lse=True)
                np.testing.assert_array_equal(got.o, want.o)
                np.testing.assert_array_equal(got.lse, want.lse)

    def test_the_client_refuses_a_bad_scale_naming_it(self):
        rng = rng_for(self, 804)
        b = quantised(random_bundle(rng, **SHAPES[1]), 1.0)
        for bad in (0.0, -1.0, math.nan, math.inf):
            with self.subTest(kv_scale=bad):
                with self.assertRaisesRegex(InvalidBundleError, r"kv_scale: .* must be finite"):
                    self.inline.verify(**dict(b, kv_scale=bad))
        plain = random_bundle(rng, **SHAPES[1])
        with self.assertRaisesRegex(InvalidBundleError, r"kv_scale: 2.0 is for an e4m3 pool"):
            self.inline.verify(**plain, kv_scale=2.0)
        with self.assertRaisesRegex(InvalidBundleError, r"kv_pool: dtype float32"):
            self.inline.verify(**dict(plain, kv_pool=from_bf16(plain["kv_pool"])))

    def test_the_daemon_refuses_a_bad_scale_and_keeps_serving(self):
        rng = rng_for(self, 805)
        b = quantised(random_bundle(rng, **SHAPES[1]), 1.0)
        args = {k: v for k, v in b.items()}
        req = make_bundle(**args).to_request()
        for bad in (0.0, -2.0, math.nan):
            with self.subTest(kv_scale=bad):
                req.kv_scale = bad
                with self.assertRaises(VerifydError) as e:
                    try:
                        self.inline._stub.Verify(req, timeout=60)  # noqa: SLF001 - the raw call
                    except grpc.RpcError as err:
                        raise VerifydError.from_rpc_error(err) from None
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertTrue(e.exception.message.startswith("kv_scale: "), e.exception.message)
        got = self.inline.verify(**b)
        self.assertLess(rel_l2(from_bf16(got.o).astype(np.float64), oracle(b)[0]), 4e-3)

    @unittest.skipUnless(HAVE_TORCH, "torch is not installed")
    def test_a_torch_float8_pool(self):
        import torch  # noqa: PLC0415 - optional

        rng = rng_for(self, 806)
        b = quantised(random_bundle(rng, **SHAPES[2]), 0.5)
        pool = torch.from_numpy(b["kv_pool"]).view(torch.float8_e4m3fn)
        got = self.inline.verify(**dict(b, kv_pool=pool))
        self.assertLess(rel_l2(from_bf16(got.o).astype(np.float64), oracle(b)[0]), 4e-3)


if __name__ == "__main__":
    unittest.main()
