"""Generates the gRPC stubs into the package while it is built (metadata is in pyproject.toml).

The stubs of ../../proto/verifyd/v1/*.proto go to verifyd_client/_gen in the build directory,
where verifyd_client/_proto.py finds them; generate.sh does the generating.

A build that fails says which interpreter ran it: `pip` is the one of the first python3 on PATH,
often a pyenv or a virtualenv without Debian's python3-setuptools and python3-wheel (which
--no-build-isolation needs) or without python3-grpcio (which the installed client needs).
"""

import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = f"{sys.executable} (Python {sys.version.split()[0]})"


def _fail(why):
    sys.exit(f"verifyd-client: {why}\n  This build runs under {PYTHON}. With Debian's packages, "
             f"build with Debian's interpreter instead: /usr/bin/python3 -m pip install "
             f"--no-build-isolation ./clients/python (python3-setuptools, python3-wheel), or "
             f"drop --no-build-isolation so that pip fetches what the build needs.")


for _module, _package in (("setuptools", "python3-setuptools"), ("wheel", "python3-wheel")):
    if importlib.util.find_spec(_module) is None:
        _fail(f"no '{_module}' module to build with (Debian: {_package})")

from setuptools import setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "verifyd_client", "_gen")
        try:
            subprocess.check_call([os.path.join(HERE, "generate.sh"), out])
        except (OSError, subprocess.CalledProcessError) as e:
            _fail(f"generate.sh could not write the gRPC stubs ({e}); it needs protoc and "
                  f"grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc)")


setup(cmdclass={"build_py": BuildWithStubs})
