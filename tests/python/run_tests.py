#!/usr/bin/env python3
"""Runs Python unittest modules against a real verifyd: run_tests.py VERIFYD_BIN MODULE...

Exits 77 (CTest's skip code) when this python3 lacks grpc, protobuf or numpy, or when no
generated stubs are at $VERIFYD_CLIENT_GEN and they cannot be generated.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))
SKIP = 77


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    for mod in ("grpc", "google.protobuf", "numpy"):
        if importlib.util.find_spec(mod.split(".")[0]) is None or \
                importlib.util.find_spec(mod) is None:
            skip(f"{sys.executable} has no '{mod}' (apt-get install python3-grpcio "
                 f"python3-protobuf python3-numpy)")
    gen = os.environ.get("VERIFYD_CLIENT_GEN", "")
    if not os.path.isfile(os.path.join(gen, "verifyd", "v1", "verify_pb2.py")):
        gen = tempfile.mkdtemp(prefix="verifyd-py-gen-")
        r = subprocess.run([os.path.join(CLIENT, "generate.sh"), gen], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            skip(f"no generated stubs and generate.sh failed: {r.stderr.strip()}")
        os.environ["VERIFYD_CLIENT_GEN"] = gen
    os.environ["VERIFYD_BIN"] = os.path.abspath(sys.argv[1])
    sys.path[:0] = [CLIENT, HERE]
    print(f"python {sys.version.split()[0]}, stubs in {os.environ['VERIFYD_CLIENT_GEN']}")
    suite = unittest.defaultTestLoader.loadTestsFromNames(sys.argv[2:])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
