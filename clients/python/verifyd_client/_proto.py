"""Loads the generated protobuf and gRPC stubs of proto/verifyd/v1.

The stubs import each other as top-level ``verifyd.v1.*`` modules, so the directory that holds
``verifyd/v1/*_pb2.py`` must be on ``sys.path``. It is looked for, in order, in
``$VERIFYD_CLIENT_GEN``, in this package's ``_gen/`` (where ``generate.sh`` writes) and on the
existing ``sys.path``.
"""

import os
import sys


def _stub_dirs():
    env = os.environ.get("VERIFYD_CLIENT_GEN")
    if env:
        yield env
    yield os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gen")


def _add_stub_dir():
    for d in _stub_dirs():
        if os.path.isfile(os.path.join(d, "verifyd", "v1", "verify_pb2.py")):
            if d not in sys.path:
                sys.path.insert(0, d)
            return


_add_stub_dir()
try:
    from verifyd.v1 import admin_pb2, admin_pb2_grpc, types_pb2, verify_pb2, verify_pb2_grpc
except ImportError as e:  # pragma: no cover - depends on the installation
    if (e.name or "").split(".")[0] in ("grpc", "google"):
        raise ImportError(
            f"verifyd_client: {sys.executable} (Python {sys.version.split()[0]}) has no "
            f"'{e.name}': install grpcio and protobuf for this interpreter, or run the client "
            f"with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf)") from e
    raise ImportError(
        "verifyd_client: the generated stubs of proto/verifyd/v1 were not found; run "
        "clients/python/generate.sh or build the verifyd_python_proto CMake target and set "
        "VERIFYD_CLIENT_GEN to its gen/ directory") from e

__all__ = ["admin_pb2", "admin_pb2_grpc", "types_pb2", "verify_pb2", "verify_pb2_grpc"]
