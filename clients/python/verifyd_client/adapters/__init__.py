"""Adapters from SGLang's target-verify attention backends to verifyd's verify call.

Each backend module (triton, flashinfer_mla, flashmla) has ``verify_args(...)``: the backend's
own arguments in, a VerifyArgs out, converted on the GPU with torch ops and no host
synchronisation (capturable in a CUDA graph). ``run(client, args)`` makes the eager call.
"""

from .common import VerifyArgs, run

__all__ = ["VerifyArgs", "run"]
