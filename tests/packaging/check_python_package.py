#!/usr/bin/env python3
"""`pip install ./clients/python` works offline, and the installed package talks to verifyd.

  check_python_package.py VERIFYD CLIENT_DIR

Installs the package with pip (--no-deps --no-build-isolation --no-index: Debian's setuptools
and wheel build it, the build generates the gRPC stubs) into a temp directory; checks the
declared dependencies; then, in a fresh interpreter that sees only that directory and the
system's site packages, imports verifyd_client (stubs from the install, not from the source or
build tree) and calls a real verifyd's data plane and admin service with it.
Exits 77 (skipped) without pip, setuptools, wheel, grpc or numpy in this python3.
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

SKIP = 77

CLIENT_CHECK = r"""
import os, subprocess, sys, tempfile, time
target, verifyd = sys.argv[1], sys.argv[2]
import verifyd_client
from verifyd_client import _proto, AdminClient, VerifyClient
for mod in (verifyd_client, _proto.verify_pb2, _proto.admin_pb2_grpc):
    if not os.path.realpath(mod.__file__).startswith(os.path.realpath(target) + os.sep):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not from the install in {target}")
d = tempfile.mkdtemp(prefix="verifyd-pkg-")
log = open(os.path.join(d, "log"), "wb")
p = subprocess.Popen([verifyd, f"--listen=unix:{d}/data.sock", f"--admin_listen=unix:{d}/admin.sock",
                      "--metrics_address=", f"--state_dir={d}/state", "--engine=cpu",
                      "--cpu_threads=1", "--probe=false"], stdout=log, stderr=subprocess.STDOUT)
try:
    deadline = time.monotonic() + 30
    health = None
    with VerifyClient(f"unix:{d}/data.sock", timeout=2) as c:
        while time.monotonic() < deadline and p.poll() is None:
            try:
                health = c.health()
                if health == "SERVING":
                    break
            except Exception:
                time.sleep(0.05)
    if health != "SERVING":
        sys.exit(f"verifyd health {health!r}:\n" + open(os.path.join(d, "log")).read())
    with AdminClient(f"unix:{d}/admin.sock", timeout=5) as a:
        mode = a.status()["mode"]
    print(f"installed verifyd_client: health {health}, mode {mode}")
finally:
    p.terminate()
    p.wait(timeout=15)
"""


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def main():
    verifyd, client_dir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    for mod in ("pip", "setuptools", "wheel", "grpc", "numpy"):
        if importlib.util.find_spec(mod) is None:
            skip(f"{sys.executable} has no {mod} (apt-get install python3-pip python3-setuptools "
                 f"python3-wheel python3-grpcio python3-numpy)")
    problems = []
    with tempfile.TemporaryDirectory(prefix="verifyd-pip-") as tmp:
        target = os.path.join(tmp, "site")
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("VERIFYD_CLIENT_GEN", None)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                            "--no-build-isolation", "--no-index", "--target", target, client_dir],
                           env=env, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            print("FAIL: pip install failed")
            return 1
        for stub in ("types_pb2", "verify_pb2", "verify_pb2_grpc", "admin_pb2", "admin_pb2_grpc"):
            if not os.path.isfile(os.path.join(target, "verifyd_client", "_gen", "verifyd", "v1",
                                               stub + ".py")):
                problems.append(f"the installed package has no generated {stub}.py")
        meta = glob.glob(os.path.join(target, "verifyd_client-*.dist-info", "METADATA"))
        requires = []
        if meta:
            requires = [line.split(":", 1)[1].strip() for line in open(meta[0], encoding="utf-8")
                        if line.startswith("Requires-Dist:")]
        else:
            problems.append("no dist-info METADATA installed")
        names = {re.match(r"[A-Za-z0-9_.-]+", q).group(0).lower(): q for q in requires}
        for dep in ("grpcio", "protobuf", "numpy"):
            if dep not in names or "extra" in names[dep]:
                problems.append(f"runtime dependency {dep} is not declared: {requires}")
        if "torch" not in names or not re.search(r"extra == [\"']torch[\"']", names["torch"]):
            problems.append(f"torch is not an optional extra 'torch': {requires}")
        # A fresh interpreter in an unrelated directory: only the install provides the package.
        env["PYTHONPATH"] = target
        r = subprocess.run([sys.executable, "-c", CLIENT_CHECK, target, verifyd], cwd=tmp, env=env,
                           capture_output=True, text=True, check=False, timeout=120)
        print(r.stdout, end="")
        if r.returncode != 0:
            problems.append(f"the installed package does not work:\n{r.stderr}")
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
