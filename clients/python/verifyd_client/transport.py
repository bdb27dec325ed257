"""How a call's tensors travel: the Transport interface and the inline transport.

A transport turns a call's arguments into a VerifyRequest and a Pending, which turns the
response into a VerifyResult. inline: every tensor's bytes in the message. shm and cuda_ipc
(shm_transport.py, cuda_ipc_transport.py): tensors named in registered regions.
"""

from . import tensors
from .bundle import make_bundle
from .result import inline_outputs, make_result, to_torch


class Pending:
    """One call between its request and its answer."""

    def __init__(self, torch_device):
        self.torch_device = torch_device  # q's device when q was a torch tensor, else None

    def decode(self, resp):
        """The VerifyResult; the call's staging goes back to its transport."""
        o, lse = inline_outputs(resp)
        if self.torch_device is not None:
            o, lse = to_torch(o, lse, self.torch_device)
        return make_result(resp, o, lse)

    def release(self):
        """The call failed and verifyd is done with it."""

    def abandon(self):
        """The call may still be running in verifyd (a cancelled stream)."""


class SlotPending(Pending):
    """A call that holds a staging slot of a SlotRing (shm, cuda_ipc) until it is answered.

    o_at, lse_at: where verifyd writes o and lse in the slot, (offset, shape); lse_at is None
    without want_lse."""

    def __init__(self, ring, slot, o_at, lse_at, torch_device):
        super().__init__(torch_device)
        self._ring, self._slot = ring, slot
        self._o_at, self._lse_at = o_at, lse_at

    def release(self):
        if self._slot is not None:
            self._ring.release(self._slot)
            self._slot = None

    def abandon(self):
        if self._slot is not None:
            self._ring.retire(self._slot)
            self._slot = None


class Transport:
    kind = "inline"

    def encode(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale, want_lse,
               request_id, compact, device, compare_sync, mask_format, kv_scale=None):
        """(VerifyRequest, Pending) of one call."""
        bundle = make_bundle(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                             mask_format=mask_format, compact=compact, kv_scale=kv_scale)
        req = bundle.to_request(want_lse=want_lse, request_id=request_id,
                                device=0 if device is None else device,
                                compare_sync=compare_sync)
        return req, Pending(torch_device=q.device if tensors.is_torch(q) else None)

    def register_kv_pool(self, pool):
        raise ValueError(f"register_kv_pool: the '{self.kind}' transport sends tensors in the "
                         f"message; create the client with transport='shm' or 'cuda_ipc'")

    def register_buffer(self, tensor):
        raise ValueError(f"register_buffer: needs transport='cuda_ipc', not '{self.kind}' (shm: "
                         f"allocate the array with shm_array)")

    def close(self):
        pass
