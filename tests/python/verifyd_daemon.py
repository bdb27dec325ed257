"""Runs the real verifyd binary for a test: CPU engine, unix sockets in a temp dir, port 0."""

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request

from verifyd_client import AdminClient, VerifyClient


def verifyd_binary():
    path = os.environ.get("VERIFYD_BIN", "")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"VERIFYD_BIN: '{path}' is not an executable verifyd")
    return path


class Daemon:
    """One verifyd process; ``data``/``admin`` are its gRPC targets, ``metrics_url`` its page.

    With ``tcp`` it also listens on 127.0.0.1 (a free port): ``data_tcp`` is that target.
    """

    def __init__(self, *extra_flags, tcp=False):
        self.dir = tempfile.mkdtemp(prefix="verifyd-py-")
        self.data = f"unix:{self.dir}/verifyd.sock"
        self.admin = f"unix:{self.dir}/admin.sock"
        self.log_path = os.path.join(self.dir, "log")
        self._log = open(self.log_path, "wb")
        listen = self.data + (",127.0.0.1:0" if tcp else "")
        self.proc = subprocess.Popen(
            [verifyd_binary(), f"--listen={listen}", f"--admin_listen={self.admin}",
             "--metrics_address=127.0.0.1:0", f"--state_dir={self.dir}/state", "--engine=cpu",
             "--cpu_threads=2", "--capture_dir=off", "--probe=false", *extra_flags],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.metrics_url = self._wait_ready()
        self.data_tcp = None
        if tcp:
            with AdminClient(self.admin) as admin:
                bound = admin.status()["runtime"]["listen"]
            self.data_tcp = next(a for a in bound if not a.startswith("unix:"))

    def _wait_ready(self, seconds=120):
        deadline = time.monotonic() + seconds
        with VerifyClient(self.data, timeout=2) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"verifyd exited with {self.proc.returncode}:\n{self.log()}")
                m = re.search(r"metrics on (http://\S+/metrics)", self.log())
                if m and os.path.exists(f"{self.dir}/admin.sock"):
                    try:
                        if c.health() == "SERVING":
                            return m.group(1)
                    except Exception:  # noqa: BLE001 - not listening yet
                        pass
                time.sleep(0.05)
        raise RuntimeError(f"verifyd did not become ready in {seconds} s:\n{self.log()}")

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def metrics(self):
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

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
