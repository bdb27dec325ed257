"""verifyd_client over TLS (CPU engine): a verifyd serving its data plane and a token-guarded
admin API on TCP with TLS, driven by VerifyClient and AdminClient; the environment defaults,
the hint a plaintext client gets, a CA that did not sign the certificate, and mutual TLS.

The CA and the certificates are made for the test with the openssl CLI (skipped without it).
"""

import os
import re
import shutil
import subprocess
import tempfile
import time
import unittest
from unittest import mock

import grpc
import numpy as np

from random_bundles import oracle, random_bundle, rel_l2
from verifyd_client import AdminClient, VerifyClient, VerifydError, from_bf16
from verifyd_daemon import verifyd_binary

PKI = r"""set -e
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $key -keyout ca.key -out ca.pem -days 1 -subj /CN=verifyd-test-ca
openssl req -x509 $key -keyout other-ca.key -out other-ca.pem -days 1 -subj /CN=another-ca
openssl req $key -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
  -extfile server.ext -out server.pem
openssl req $key -keyout client.key -out client.csr -subj /CN=verifyd-test-client
printf 'extendedKeyUsage=clientAuth\n' >client.ext
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
  -extfile client.ext -out client.pem
"""

# Environment variables the clients read; cleared around each test so that the caller's own
# settings do not leak in.
ENV = ("VERIFYD_TARGET", "VERIFYD_ADMIN", "VERIFYD_TLS_CA_FILE", "VERIFYD_TLS_CERT_FILE",
       "VERIFYD_TLS_KEY_FILE")


class TlsDaemon:
    """verifyd with TLS on TCP (data plane and admin with a token) and a Unix data socket."""

    def __init__(self, pki, *extra_flags):
        self.dir = tempfile.mkdtemp(prefix="verifyd-tls-")
        self.unix = f"unix:{self.dir}/verifyd.sock"
        self.token_file = os.path.join(self.dir, "token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("s3cret-admin-token\n")
        self.log_path = os.path.join(self.dir, "log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [verifyd_binary(), f"--listen=127.0.0.1:0,{self.unix}", "--admin_listen=127.0.0.1:0",
             f"--admin_token_file={self.token_file}", f"--tls_cert_file={pki}/server.pem",
             f"--tls_key_file={pki}/server.key", "--metrics_address=127.0.0.1:0",
             f"--state_dir={self.dir}/state", "--engine=cpu", "--cpu_threads=2",
             "--capture_dir=off", "--probe=false", "--gate_window=4", *extra_flags],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"verifyd exited with {self.proc.returncode}:\n{self.log()}")
            log = self.log()
            data = re.search(r"data plane on (127\.0\.0\.1:\d+)", log)
            admin = re.search(r"admin on (127\.0\.0\.1:\d+)", log)
            if data and admin and "metrics on" in log:
                self.data, self.admin = data.group(1), admin.group(1)
                return
            time.sleep(0.05)
        raise RuntimeError(f"verifyd did not start in 120 s:\n{self.log()}")

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_pki():
    d = tempfile.mkdtemp(prefix="verifyd-pki-")
    r = subprocess.run(["bash", "-c", PKI], cwd=d, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"openssl failed:\n{r.stderr}")
    return d


@unittest.skipIf(shutil.which("openssl") is None, "no openssl CLI to make certificates")
class TlsTest(unittest.TestCase):
    """Server TLS: the client checks verifyd's certificate against tls_ca_file."""

    @classmethod
    def setUpClass(cls):
        cls.pki = make_pki()
        cls.ca = os.path.join(cls.pki, "ca.pem")
        cls.daemon = TlsDaemon(cls.pki)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.pki, ignore_errors=True)

    def setUp(self):
        patcher = mock.patch.dict(os.environ, {k: "" for k in ENV})
        patcher.start()
        self.addCleanup(patcher.stop)

    def bundle(self, seed):
        return random_bundle(np.random.default_rng(seed), batch=2, draft=4, heads=2,
                             page_size=16, prefixes=[20, 3])

    def check_output(self, b, r):
        self.assertLess(rel_l2(from_bf16(r.o).astype(np.float64), oracle(b)[0]), 1e-2)

    def test_verify_unary_and_stream_over_tls(self):
        b = self.bundle(1)
        with VerifyClient(self.daemon.data, timeout=60, tls_ca_file=self.ca) as c:
            self.assertTrue(c.tls)
            self.assertEqual(c.health(), "SERVING")
            r = c.verify(**b, compare_sync=True, request_id="tls-1")
            self.check_output(b, r)
            self.assertEqual(r.served_path, "reference")
            self.assertTrue(r.comparison["match"])
            with c.stream() as s:
                self.check_output(b, s.verify(**b))

    def test_admin_over_tls_with_token(self):
        with AdminClient(self.daemon.admin, token_file=self.daemon.token_file,
                         tls_ca_file=self.ca) as admin:
            st = admin.status()
            self.assertIn(st["mode"], ("shadow", "custom"))
            self.assertEqual(admin.set_sampling("custom", 0.5, reason="tls test")
                             ["custom_sample_rate"], 0.5)
            self.assertEqual(admin.flip("custom", reason="tls test", force=True)["mode"],
                             "custom")
            self.assertEqual(admin.rollback(reason="tls test")["mode"], "shadow")
            audit = admin.status()["audit"]
            self.assertTrue(audit[-1]["peer"].startswith("token:"), audit[-1])
        with AdminClient(self.daemon.admin, token="wrong", tls_ca_file=self.ca) as admin:
            with self.assertRaises(VerifydError) as e:
                admin.status()
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)

    def test_environment_defaults(self):
        with mock.patch.dict(os.environ, {"VERIFYD_TARGET": self.daemon.data,
                                          "VERIFYD_ADMIN": self.daemon.admin,
                                          "VERIFYD_TLS_CA_FILE": self.ca}):
            with VerifyClient(timeout=60) as c:
                self.assertEqual((c.target, c.tls), (self.daemon.data, True))
                self.check_output(self.bundle(2), c.verify(**self.bundle(2)))
            with AdminClient(token_file=self.daemon.token_file) as admin:
                self.assertTrue(admin.tls)
                self.assertIn("mode", admin.status())
            # A Unix socket stays plaintext whatever the environment says.
            with VerifyClient(self.daemon.unix, timeout=60) as c:
                self.assertFalse(c.tls)
                self.assertEqual(c.health(), "SERVING")
            # "" turns the environment's CA off: a plaintext client, and the hint.
            with VerifyClient(tls_ca_file="", timeout=10) as c:
                self.assertFalse(c.tls)
                with self.assertRaises(VerifydError) as e:
                    c.health()
                self.assertIn("serving TLS? pass tls_ca_file", str(e.exception))

    def test_plaintext_client_gets_a_hint(self):
        with VerifyClient(self.daemon.data, timeout=10) as c:
            with self.assertRaises(VerifydError) as e:
                c.verify(**self.bundle(3))
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn(f"is {self.daemon.data} serving TLS? pass tls_ca_file", e.exception.hint)
        self.assertIn("serving TLS? pass tls_ca_file (VERIFYD_TLS_CA_FILE)", str(e.exception))
        with AdminClient(self.daemon.admin, token_file=self.daemon.token_file) as admin:
            with self.assertRaises(VerifydError) as e:
                admin.status()
        self.assertIn("serving TLS? pass tls_ca_file", str(e.exception))

    def test_a_ca_that_did_not_sign_the_certificate_fails_with_a_hint(self):
        with VerifyClient(self.daemon.data, timeout=10,
                          tls_ca_file=os.path.join(self.pki, "other-ca.pem")) as c:
            with self.assertRaises(VerifydError) as e:
                c.health()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("tls_ca_file signed", str(e.exception))

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "tls_ca_file: cannot read"):
            VerifyClient(self.daemon.data, tls_ca_file=os.path.join(self.pki, "missing.pem"))
        with self.assertRaisesRegex(ValueError, "tls_ca_file: .* holds no PEM block"):
            VerifyClient(self.daemon.data, tls_ca_file=self.daemon.token_file)
        with self.assertRaisesRegex(ValueError, "tls_cert_file, tls_key_file: give both"):
            VerifyClient(self.daemon.data, tls_ca_file=self.ca,
                         tls_cert_file=os.path.join(self.pki, "client.pem"))
        with self.assertRaisesRegex(ValueError, "is a path; a Unix socket is written unix:/x"):
            VerifyClient("/x")


@unittest.skipIf(shutil.which("openssl") is None, "no openssl CLI to make certificates")
class MutualTlsTest(unittest.TestCase):
    """--tls_client_ca_file: verifyd asks each TCP client for a certificate its CA signed."""

    @classmethod
    def setUpClass(cls):
        cls.pki = make_pki()
        cls.daemon = TlsDaemon(cls.pki, f"--tls_client_ca_file={cls.pki}/ca.pem")

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.pki, ignore_errors=True)

    def setUp(self):
        patcher = mock.patch.dict(os.environ, {k: "" for k in ENV})
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_client_certificate(self):
        p = self.pki
        with VerifyClient(self.daemon.data, tls_ca_file=f"{p}/ca.pem",
                          tls_cert_file=f"{p}/client.pem", tls_key_file=f"{p}/client.key") as c:
            self.assertEqual(c.health(), "SERVING")
        with mock.patch.dict(os.environ, {"VERIFYD_TLS_CA_FILE": f"{p}/ca.pem",
                                          "VERIFYD_TLS_CERT_FILE": f"{p}/client.pem",
                                          "VERIFYD_TLS_KEY_FILE": f"{p}/client.key"}):
            with AdminClient(self.daemon.admin, token_file=self.daemon.token_file) as admin:
                self.assertIn("mode", admin.status())
        with VerifyClient(self.daemon.data, timeout=10, tls_ca_file=f"{p}/ca.pem") as c:
            with self.assertRaises(VerifydError) as e:
                c.health()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("also needs tls_cert_file and tls_key_file", str(e.exception))


if __name__ == "__main__":
    unittest.main()
