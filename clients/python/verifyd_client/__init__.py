"""verifyd_client: the serving stack's client of verifyd (MLA tree-verify attention shadowing).

    from verifyd_client import VerifyClient
    with VerifyClient("unix:/run/verifyd/verifyd.sock") as c:
        r = c.verify(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale)
        r.o  # bf16 [B*T, H, 512]

Zero-copy transports: VerifyClient(target, transport="shm") for host arrays,
transport="cuda_ipc" for torch CUDA tensors; register the serving pool once with
client.register_kv_pool(pool). verifyd_client.adapters converts the arguments of SGLang's
target-verify backends (triton, flashinfer_mla, flashmla) on the GPU; sglang_target_verify is
the Triton adapter's one-call form.

Without a target, VerifyClient and AdminClient use $VERIFYD_TARGET / $VERIFYD_ADMIN, else the
systemd unit's sockets; TCP targets speak TLS with tls_ca_file (and tls_cert_file, tls_key_file
for mutual TLS), by default $VERIFYD_TLS_CA_FILE (..._CERT_FILE, ..._KEY_FILE), as verifyctl.
"""

import importlib.util as _util
import sys as _sys

for _module, _debian in (("grpc", "python3-grpcio"), ("google.protobuf", "python3-protobuf"),
                         ("numpy", "python3-numpy")):
    try:
        _found = _util.find_spec(_module) is not None
    except ModuleNotFoundError:  # "google" itself is missing
        _found = False
    if not _found:
        raise ImportError(
            f"verifyd_client: {_sys.executable} (Python {_sys.version.split()[0]}) has no "
            f"'{_module}': install it for this interpreter (pip install grpcio protobuf numpy), "
            f"or run the client with Debian's /usr/bin/python3 ({_debian})", name=_module)

from .admin import AdminClient  # noqa: E402
from .bundle import Bundle, make_bundle  # noqa: E402
from .call_channel import CallChannel  # noqa: E402
from .client import REQUEST_BYTES_KEY, VerifyClient, VerifyStream  # noqa: E402
from .errors import InvalidBundleError, VerifydError  # noqa: E402
from .result import VerifyResult  # noqa: E402
from .sglang import sglang_target_verify  # noqa: E402
from .tensors import from_bf16, from_e4m3, pack_mask, to_bf16, to_e4m3, unpack_mask  # noqa: E402

__all__ = ["AdminClient", "Bundle", "CallChannel", "InvalidBundleError", "REQUEST_BYTES_KEY",
           "VerifyClient", "VerifyResult",
           "VerifyStream", "VerifydError", "from_bf16", "from_e4m3", "make_bundle", "pack_mask",
           "sglang_target_verify", "to_bf16", "to_e4m3", "unpack_mask"]
