"""verifyd_client's descriptor passing (vmm_fds) and RegisterCudaVmmRegion against the real
verifyd (CPU engine): descriptors sent on the descriptor socket, the token named in the call,
and the refusals, each naming its field. The chunks themselves need a GPU
(tests/python/gpu_vmm_test.py); here they are pipes.
"""

import os
import socket
import unittest

import grpc

from verifyd_client import VerifyClient, VerifydError, vmm_fds
from verifyd_daemon import Daemon


def pipes(n):
    fds = []
    for _ in range(n):
        r, w = os.pipe()
        os.close(w)
        fds.append(r)
    return fds


class VmmFdsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.client = VerifyClient(cls.daemon.data, timeout=60)
        cls.path = vmm_fds.socket_path(cls.daemon.data)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.daemon.stop()

    def send(self, token, n):
        fds = pipes(n)
        try:
            vmm_fds.send(self.path, token, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def register(self, token, chunks):
        return self.client._regions.register_cuda_vmm("vmm", token, chunks, 0, 0, 1 << 20,
                                                      self.client.client_id)

    def test_socket_path(self):
        self.assertEqual(self.path, self.daemon.data[len("unix:"):] + ".fds")
        self.assertEqual(vmm_fds.socket_path("unix:///run/v/verifyd.sock"), "/run/v/verifyd.sock.fds")
        self.assertIsNone(vmm_fds.socket_path("127.0.0.1:50051"))

    def test_a_complete_set_reaches_the_engine(self):
        token = vmm_fds.new_token()
        self.send(token, 300)  # two messages: 253 and 47
        with self.assertRaises(VerifydError) as e:
            self.register(token, [2 << 20] * 300)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(e.exception.field, "chunks")
        self.assertIn("this engine has no GPU", e.exception.message)
        # The token was used up.
        with self.assertRaises(VerifydError) as e:
            self.register(token, [2 << 20] * 300)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(e.exception.field, "token")

    def test_refusals_name_the_field(self):
        with self.assertRaises(VerifydError) as e:
            self.register(vmm_fds.new_token(), [2 << 20])
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(e.exception.field, "token")
        with self.assertRaises(VerifydError) as e:
            self.send(b"\0" * 16, 1)
        self.assertEqual(e.exception.field, "token")
        token = vmm_fds.new_token()
        self.send(token, 2)
        with self.assertRaises(VerifydError) as e:
            self.register(token, [2 << 20])
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(e.exception.field, "chunks")
        # A message without descriptors, sent by hand.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(self.path)
            s.sendmsg([vmm_fds.payload(vmm_fds.new_token(), 0, 1)])
            self.assertTrue(s.recv(1024).startswith(b"fds: the message carries no descriptors"))
        self.assertEqual(self.client.list_regions(), [])


if __name__ == "__main__":
    unittest.main()
