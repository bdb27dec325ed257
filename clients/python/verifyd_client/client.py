"""The data-plane client: Verify calls, unary or over one long-lived stream."""

import collections
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
import numpy as np

from . import tensors
from ._channel import ChannelClient
from ._proto import types_pb2, verify_pb2_grpc
from .bundle import make_bundle
from .errors import VerifydError, status_code

TRANSPORTS = ("inline", "shm", "cuda_ipc")

# Unlimited in the client; the daemon's --max_message_mb is the limit that applies.
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1),
                    ("grpc.max_receive_message_length", -1)]


def _path_name(p):
    return types_pb2.PathKind.Name(p)[len("PATH_"):].lower()


def _mode_name(m):
    return types_pb2.Mode.Name(m)[len("MODE_"):].lower()


def _comparison(c):
    return {"test": _path_name(c.test), "ref": _path_name(c.ref), "rel_l2": c.rel_l2,
            "max_abs": c.max_abs, "nmse": c.nmse, "beyond_tol": c.beyond_tol,
            "nan_test": c.nan_test, "inf_test": c.inf_test, "nan_ref": c.nan_ref,
            "inf_ref": c.inf_ref, "lse_max_abs": c.lse_max_abs, "match": c.match,
            "reason": c.reason, "count": c.count}


@dataclass
class VerifyResult:
    """One call's answer.

    o: bf16 [B*T, H, 512], as uint16 bit patterns (numpy) or a torch.bfloat16 tensor on q's
    device when q was a torch tensor. lse: float32 [B*T, H] when asked for, else None.
    """
    o: Any
    lse: Any
    served_path: str                      # "reference" or "custom"
    mode: str                             # "reference", "shadow", "canary" or "custom"
    comparison: Optional[dict]            # with compare_sync, when the call was compared
    timing: dict = field(default_factory=dict)  # server seconds per stage
    request_id: str = ""


@dataclass
class _Pending:
    torch_device: Any  # q's device when q was a torch tensor, else None


def _decode(resp, pending):
    o = np.frombuffer(resp.o.raw_contents, dtype="<u2").reshape(tuple(resp.o.shape))
    lse = None
    if resp.HasField("lse"):
        lse = np.frombuffer(resp.lse.raw_contents, dtype="<f4").reshape(tuple(resp.lse.shape))
    if pending.torch_device is not None:
        import torch  # noqa: PLC0415 - present whenever q was a tensor

        o = torch.from_numpy(o.view(np.int16).copy()).view(torch.bfloat16).to(pending.torch_device)
        if lse is not None:
            lse = torch.from_numpy(lse.copy()).to(pending.torch_device)
    t = resp.timing
    return VerifyResult(
        o=o, lse=lse, served_path=_path_name(resp.served_path), mode=_mode_name(resp.mode),
        comparison=_comparison(resp.comparison) if resp.HasField("comparison") else None,
        timing={"decode": t.decode_seconds, "prepare": t.prepare_seconds,
                "served": t.served_seconds, "fetch": t.fetch_seconds, "total": t.total_seconds},
        request_id=resp.request_id)


def _encode(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale, want_lse,
            request_id, compact, device, compare_sync, mask_format):
    bundle = make_bundle(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                         mask_format=mask_format, compact=compact)
    req = bundle.to_request(want_lse=want_lse, request_id=request_id, device=device,
                            compare_sync=compare_sync)
    return req, _Pending(torch_device=q.device if tensors.is_torch(q) else None)


def _check_transport(transport):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: '{transport}' is not one of {', '.join(TRANSPORTS)}")
    if transport != "inline":
        raise NotImplementedError(
            f"transport '{transport}': verifyd does not serve shared-memory or CUDA IPC tensors "
            f"yet (it answers UNIMPLEMENTED); use transport='inline'")


class VerifyClient(ChannelClient):
    """Sends verify-attention calls to verifyd's data plane.

    target: "HOST:PORT" or "unix:PATH". timeout: seconds per unary call (None: no deadline).
    """

    def __init__(self, target, timeout=30.0, transport="inline", channel_options=None):
        _check_transport(transport)
        super().__init__(target, timeout, _CHANNEL_OPTIONS + list(channel_options or []))
        self._stub = verify_pb2_grpc.VerifyServiceStub(self._channel)

    def verify(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
               want_lse=False, request_id=None, compact=True, device=0, compare_sync=False,
               mask_format=None):
        """One Verify call; see bundle.make_bundle for the tensors and what ``compact`` does.

        Raises InvalidBundleError before sending a bundle the daemon would refuse, and
        VerifydError (with .code, .message, .field) for an error the daemon answers.
        """
        req, pending = _encode(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                               want_lse, request_id, compact, device, compare_sync, mask_format)
        try:
            resp = self._stub.Verify(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise VerifydError.from_rpc_error(e) from None
        return _decode(resp, pending)

    def stream(self, timeout=None):
        """A VerifyStream context manager: calls in order over one bidirectional stream."""
        return VerifyStream(self._stub, timeout)

    def health(self, service="", timeout=5.0):
        """grpc.health.v1 Check on the data plane: "SERVING", "NOT_SERVING", ...

        The two messages are encoded by hand so no grpcio-health-checking package is needed.
        """
        name = service.encode()
        req = (b"\x0a" + _varint(len(name)) + name) if name else b""
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            resp = check(req, timeout=timeout)
        except grpc.RpcError as e:
            raise VerifydError.from_rpc_error(e) from None
        status = resp[1] if len(resp) >= 2 and resp[0] == 0x08 else 0
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(
            status, "UNKNOWN")


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_END = object()


class VerifyStream:
    """Calls over one VerifyStream; responses come back in request order.

    ``verify(...)`` sends and waits; ``send(...)`` and ``recv()`` pipeline several calls. An
    error on one call raises VerifydError from its ``recv`` and leaves the stream open.
    """

    def __init__(self, stub, timeout):
        self._requests = queue.Queue()
        self._pending = collections.deque()
        self._lock = threading.Lock()
        self._call = stub.VerifyStream(iter(self._requests.get, _END), timeout=timeout)
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.cancel()

    def send(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
             want_lse=False, request_id=None, compact=True, device=0, compare_sync=False,
             mask_format=None):
        if self._closed:
            raise RuntimeError("VerifyStream: send after close")
        req, pending = _encode(q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
                               want_lse, request_id, compact, device, compare_sync, mask_format)
        with self._lock:
            self._pending.append(pending)
            self._requests.put(req)

    def recv(self):
        with self._lock:
            if not self._pending:
                raise RuntimeError("VerifyStream: recv with no call in flight")
            pending = self._pending.popleft()
        try:
            resp = next(self._call)
        except grpc.RpcError as e:
            raise VerifydError.from_rpc_error(e) from None
        except StopIteration:
            raise VerifydError(grpc.StatusCode.UNAVAILABLE,
                               "stream: verifyd closed the stream") from None
        if resp.error_code != 0:
            raise VerifydError(status_code(resp.error_code), resp.error_message)
        return _decode(resp, pending)

    def verify(self, *args, **kwargs):
        self.send(*args, **kwargs)
        return self.recv()

    def close(self):
        """Half-closes the stream and drains it; answers not yet received are dropped."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_END)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise VerifydError.from_rpc_error(e) from None

    def cancel(self):
        self._closed = True
        self._requests.put(_END)
        self._call.cancel()
