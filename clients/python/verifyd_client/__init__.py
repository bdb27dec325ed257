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

from .admin import AdminClient
from .bundle import Bundle, make_bundle
from .call_channel import CallChannel
from .client import REQUEST_BYTES_KEY, VerifyClient, VerifyStream
from .errors import InvalidBundleError, VerifydError
from .result import VerifyResult
from .sglang import sglang_target_verify
from .tensors import from_bf16, pack_mask, to_bf16, unpack_mask

__all__ = ["AdminClient", "Bundle", "CallChannel", "InvalidBundleError", "REQUEST_BYTES_KEY",
           "VerifyClient", "VerifyResult",
           "VerifyStream", "VerifydError", "from_bf16", "make_bundle", "pack_mask",
           "sglang_target_verify", "to_bf16", "unpack_mask"]
