"""Generates the gRPC stubs into the package while it is built (metadata is in pyproject.toml).

The stubs of ../../proto/verifyd/v1/*.proto go to verifyd_client/_gen in the build directory,
where verifyd_client/_proto.py finds them; generate.sh does the generating.
"""

import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "verifyd_client", "_gen")
        subprocess.check_call([os.path.join(HERE, "generate.sh"), out])


setup(cmdclass={"build_py": BuildWithStubs})
