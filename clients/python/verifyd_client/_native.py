"""Where the client finds the shared libraries verifyd's build makes for the serving process
(libverifyd_tap.so, libverifyd_kernel.so)."""

import ctypes
import os

import grpc

from .errors import VerifydError

_PLACES = ("/usr/lib/verifyd", "/usr/local/lib")


def load(filename, env, path=None, made_in=""):
    """ctypes.CDLL of ``path``, else of $``env``, else of ``filename`` in its installed places;
    FAILED_PRECONDITION naming every place tried when none has it."""
    candidates = [path] if path else (
        [os.environ[env]] if os.environ.get(env) else
        [os.path.join(d, filename) for d in _PLACES])
    for p in candidates:
        if p and os.path.exists(p):
            return p, ctypes.CDLL(p)
    raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{filename} not found (tried " + ", ".join(map(str, candidates)) +
                       f"): pass library= or set {env} to the file verifyd's build makes"
                       f" ({made_in})")
