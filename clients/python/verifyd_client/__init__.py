"""verifyd_client: the serving stack's client of verifyd (MLA tree-verify attention shadowing).

    from verifyd_client import VerifyClient
    with VerifyClient("unix:/run/verifyd/data.sock") as c:
        r = c.verify(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale)
        r.o  # bf16 [B*T, H, 512]
"""

from .admin import AdminClient
from .bundle import Bundle, make_bundle
from .client import VerifyClient, VerifyResult, VerifyStream
from .errors import InvalidBundleError, VerifydError
from .tensors import from_bf16, pack_mask, to_bf16, unpack_mask

__all__ = ["AdminClient", "Bundle", "InvalidBundleError", "VerifyClient", "VerifyResult",
           "VerifyStream", "VerifydError", "from_bf16", "make_bundle", "pack_mask", "to_bf16",
           "unpack_mask"]
