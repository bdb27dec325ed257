"""The in-process switch under verifyd's control (verify.proto, SwitchSpec; switch.py,
SwitchChannel) against the real verifyd (CPU engine): verifyd writes the mode the switch's block
asks for and renews its lease; the flip, a rollback and canary reach the block; a stopped verifyd
stops renewing (the GPU falls back to the stack when the lease ages); closing the channel hands
the stack back; what the GPU counts reaches `verifyctl status` and the metrics; a library of
another build, and bad specs, are refused naming the field. The GPU's side of the block
(verifyd_switch_begin_step) runs in tests/python/gpu_kernel_op_test.py; here the test writes the
GPU's words itself.
"""

import mmap
import os
import signal
import time
import unittest
import urllib.request

import grpc

from verifyd_client import AdminClient, VerifyClient, VerifydError
from verifyd_client.switch import MAGIC, SwitchChannel, _Block
from verifyd_daemon import Daemon


def wait_for(pred, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


class SwitchChannelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.client = VerifyClient(cls.daemon.data, timeout=60)
        cls.admin = AdminClient(cls.daemon.admin)
        cls.build = cls.admin.status()["commit"]

    @classmethod
    def tearDownClass(cls):
        cls.admin.close()
        cls.client.close()
        cls.daemon.stop()

    def open(self, lease_ms=40, model="kimi-k2.6", build=None):
        return SwitchChannel(self.client, 61, model, self.build if build is None else build,
                             lease_ms=lease_ms, mapped=False)

    def tearDown(self):
        self.admin.flip("shadow", "test_switch_channel: back to shadow")

    def test_verifyd_writes_the_mode_and_renews_the_lease(self):
        with self.open() as ch:
            b = ch.block
            self.assertEqual(b.magic, MAGIC)  # written before OpenChannel answered
            self.assertEqual(b.mode, 0)  # shadow: the stack
            self.assertEqual(b.lease_period_us, 40_000)
            epoch = b.lease_epoch
            self.assertTrue(wait_for(lambda: b.lease_epoch >= epoch + 3, 2),
                            f"lease epoch stayed at {b.lease_epoch}")
            self.admin.flip("custom", "test_switch_channel: custom", force=True)
            self.assertTrue(wait_for(lambda: b.mode == 1), f"mode {b.mode}, expected 1 (op)")
            self.admin.flip("canary", "test_switch_channel: canary", fraction=0.25, force=True)
            self.assertTrue(wait_for(lambda: b.mode == 2), f"mode {b.mode}, expected 2")
            self.assertAlmostEqual(b.canary_threshold / 2**32, 0.25, places=6)
            self.admin.rollback("test_switch_channel: roll back")
            self.assertTrue(wait_for(lambda: b.mode == 0), f"mode {b.mode} after the rollback")

    def test_a_flip_reaches_the_block_at_once_not_at_the_next_renewal(self):
        # A lease of 60 s renews every 15 s: the flip and the rollback must not wait for that.
        with self.open(lease_ms=60000) as ch:
            b = ch.block
            epoch = b.lease_epoch
            t0 = time.monotonic()
            self.admin.flip("custom", "test_switch_channel: custom", force=True)
            self.assertTrue(wait_for(lambda: b.mode == 1, 2), f"mode {b.mode}, expected 1 (op)")
            flip_s = time.monotonic() - t0
            self.assertGreater(b.lease_epoch, epoch, "the flip came without a renewal")
            t0 = time.monotonic()
            self.admin.rollback("test_switch_channel: roll back")
            self.assertTrue(wait_for(lambda: b.mode == 0, 2), f"mode {b.mode} after the rollback")
            rollback_s = time.monotonic() - t0
            # The admin call's own round trip is most of it; a quarter lease would be 15 s.
            self.assertLess(flip_s, 0.5)
            self.assertLess(rollback_s, 0.5)

    def test_a_stopped_verifyd_stops_renewing(self):
        with self.open() as ch:
            b = ch.block
            self.admin.flip("custom", "test_switch_channel: custom", force=True)
            self.assertTrue(wait_for(lambda: b.mode == 1))
            os.kill(self.daemon.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(0.05)
                frozen = b.lease_epoch
                time.sleep(0.3)  # 7 lease periods
                self.assertEqual(b.lease_epoch, frozen,
                                 "the lease was renewed while verifyd was stopped")
            finally:
                os.kill(self.daemon.proc.pid, signal.SIGCONT)
            self.assertTrue(wait_for(lambda: b.lease_epoch > frozen, 2),
                            "renewals did not resume after SIGCONT")

    def test_a_close_verifyd_cannot_hear_still_frees_the_memory(self):
        # The gRPC client closed first (a failed test, an interpreter exiting): close() says so,
        # and the shm object is gone all the same; verifyd closes its side when the process ends.
        client = VerifyClient(self.daemon.data, timeout=60)
        ch = SwitchChannel(client, 61, "m", self.build, lease_ms=40, mapped=False)
        # The object's name went when the channel opened (both sides map it): a process that
        # dies while the channel is open leaves nothing in /dev/shm.
        self.assertFalse(os.path.exists("/dev/shm" + ch.key), "named while open")
        client.close()
        with self.assertRaises(Exception):  # noqa: B017 - grpc's own error for a closed channel
            ch.close()
        mem = ch._mem  # noqa: SLF001
        self.assertTrue(mem is None or mem.shm is None, "the memory is still held")
        ch.close()  # once more: nothing left to do

    def test_closing_hands_the_stack_back(self):
        ch = self.open()
        self.admin.flip("custom", "test_switch_channel: custom", force=True)
        self.assertTrue(wait_for(lambda: ch.block.mode == 1))
        # A mapping of our own outlives close(): what verifyd wrote last stays readable. (The
        # object has no name once open: the mapping comes from the channel's own descriptor.)
        fd = os.dup(ch._mem.shm._fd)  # noqa: SLF001
        try:
            m = mmap.mmap(fd, SwitchChannel.BYTE_SIZE)
        finally:
            os.close(fd)
        try:
            block = _Block.from_buffer(m, ch.offset)
            ch.close()
            self.assertEqual(block.mode, 0, "closing the channel left the op serving")
            del block
        finally:
            m.close()

    def test_status_and_metrics_show_the_gpu_counts(self):
        with self.open(model="deepseek-v3") as ch:
            b = ch.block
            # What verifyd_switch_begin_step writes: 10 steps, 7 by the op, 2 lost to a lease.
            b.seen_at_ns = 5_000_000
            b.last_step_ns = 17_000_000
            b.op_steps = 7
            b.lease_expired = 2
            b.steps = 10

            def info():
                for c in self.admin.status()["channels"]:
                    if c["name"] == ch.name:
                        return c.get("serving_switch")
                return None

            self.assertTrue(wait_for(lambda: (info() or {}).get("steps") == 10),
                            f"status shows {info()}")
            i = info()
            self.assertEqual(i["model"], "deepseek-v3")
            self.assertEqual(i["layers"], 61)
            self.assertEqual(i["op_steps"], 7)
            self.assertEqual(i["lease_expired"], 2)
            self.assertEqual(i["path"], "stack")
            self.assertAlmostEqual(i["lease_age_ms"], 12.0)
            self.assertGreaterEqual(i["since_last_step_ms"], 0)
            page = urllib.request.urlopen(self.daemon.metrics_url, timeout=10).read().decode()
            self.assertIn('verifyd_switch_steps_total{model="deepseek-v3",path="op"} 7', page)
            self.assertIn('verifyd_switch_steps_total{model="deepseek-v3",path="stack"} 3', page)
            self.assertIn('verifyd_switch_lease_expired_total{model="deepseek-v3"} 2', page)

    def test_refusals_name_the_field(self):
        cases = [
            ({"build": "0000000"}, grpc.StatusCode.FAILED_PRECONDITION, "serving_switch.build"),
            ({"model": "Kimi K2"}, grpc.StatusCode.INVALID_ARGUMENT, "serving_switch.model"),
            ({"lease_ms": 5}, grpc.StatusCode.INVALID_ARGUMENT, "serving_switch.lease_ms"),
        ]
        for kwargs, code, field in cases:
            with self.assertRaises(VerifydError) as e:
                self.open(**kwargs)
            self.assertEqual(e.exception.code, code, kwargs)
            self.assertIn(field, str(e.exception), kwargs)
        with self.assertRaises(VerifydError) as e:
            SwitchChannel(self.client, 0, "m", self.build, mapped=False)
        self.assertIn("serving_switch.layers", str(e.exception))
        # The daemon serves on.
        with self.open() as ch:
            self.assertEqual(ch.block.magic, MAGIC)


if __name__ == "__main__":
    unittest.main()
