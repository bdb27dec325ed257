"""The data-plane client: Verify calls, unary or over one long-lived stream."""

import collections
import queue
import threading

import grpc

from ._channel import DEFAULT_DATA_TARGET, ChannelClient, resolve_target
from .call_channel import CallChannel
from ._proto import verify_pb2, verify_pb2_grpc
from .errors import VerifydError, status_code
from .regions import RegionCalls, client_id
from .transport import Transport

TRANSPORTS = ("inline", "shm", "cuda_ipc")

# Unlimited in the client; the daemon's --max_message_mb is the limit that applies.
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1),
                    ("grpc.max_receive_message_length", -1)]

# Metadata of a unary Verify call: the serialized request's size in bytes (decimal digits), so
# that verifyd admits the call to its memory budget, or refuses it, before the message arrives.
# The same key as kRequestBytesKey in src/transport/request_bytes.h.
REQUEST_BYTES_KEY = "verifyd-request-bytes"


def _transport(kind, calls, client, staging_slots, target):
    if kind == "shm":
        from .shm_transport import ShmTransport  # noqa: PLC0415

        return ShmTransport(calls, client, staging_slots, target)
    if kind == "cuda_ipc":
        from .cuda_ipc_transport import CudaIpcTransport  # noqa: PLC0415

        return CudaIpcTransport(calls, client, staging_slots, target)
    return Transport()


class VerifyClient(ChannelClient):
    """Sends verify-attention calls to verifyd's data plane.

    target: "unix:PATH" or "HOST:PORT"; None: $VERIFYD_TARGET, else the systemd unit's
    "unix:/run/verifyd/verifyd.sock". timeout: seconds per unary call (None: no deadline).
    transport: how tensors travel:
      "inline"    their bytes in each message (any target);
      "shm"       numpy arrays and CPU torch tensors through the client's own POSIX shared
                  memory, registered once as verifyd regions; o is written there by verifyd;
      "cuda_ipc"  torch CUDA tensors named in place through CUDA IPC handles; o comes back on
                  q's device without a host round trip.
    shm and cuda_ipc need a Unix socket target (or verifyd's --allow_region_tcp) and a verifyd on
    the same host. staging_slots: how many calls may be in flight at once with those transports
    (each holds one slot of staging buffers until its answer is read).
    TLS to a TCP target (verifyd's --tls_cert_file): tls_ca_file, the PEM CA that signed verifyd's
    certificate; tls_cert_file and tls_key_file, this client's certificate and key, for a verifyd
    with --tls_client_ca_file. None: $VERIFYD_TLS_CA_FILE, $VERIFYD_TLS_CERT_FILE,
    $VERIFYD_TLS_KEY_FILE ("" turns one off). A unix: target ignores them.
    Close the client (or leave its with-block) to unregister and free its regions.
    """

    def __init__(self, target=None, timeout=30.0, transport="inline", channel_options=None,
                 staging_slots=8, tls_ca_file=None, tls_cert_file=None, tls_key_file=None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: '{transport}' is not one of {', '.join(TRANSPORTS)}")
        target = resolve_target(target, "VERIFYD_TARGET", DEFAULT_DATA_TARGET)
        super().__init__(target, timeout, _CHANNEL_OPTIONS + list(channel_options or []),
                         tls_ca_file, tls_cert_file, tls_key_file)
        self._stub = verify_pb2_grpc.VerifyServiceStub(self._channel)
        # Unary Verify with the request serialized by verify() itself, which declares its size.
        self._verify = self._channel.unary_unary(
            "/verifyd.v1.VerifyService/Verify", request_serializer=None,
            response_deserializer=verify_pb2.VerifyResponse.FromString)
        # Registering maps memory and unregistering waits for the calls using a region: not
        # bound by a per-call deadline meant for Verify.
        self._regions = RegionCalls(self._stub, None if timeout is None else max(timeout, 60.0),
                                    self._hint)
        self.client_id = client_id()
        self.transport = transport
        try:
            self._transport = _transport(transport, self._regions, self.client_id,
                                         staging_slots, target)
        except BaseException:
            super().close()
            raise
        self._call_channels = []
        self._closed = False

    def verify(self, q, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, sm_scale,
               want_lse=False, request_id=None, compact=True, device=None, compare_sync=False,
               mask_format=None, kv_scale=None):
        """One Verify call; see bundle.make_bundle for the tensors and what ``compact`` does.

        kv_scale: an e4m3 pool's scale (its values are e4m3 x kv_scale; None: 1).

        device: the GPU worker (default 0; with cuda_ipc, q's device). A kv_pool registered
        with ``register_kv_pool`` is named whole and in place, never compacted.
        Raises InvalidBundleError before sending a bundle the daemon would refuse, and
        VerifydError (with .code, .message, .field) for an error the daemon answers.
        """
        req, pending = self._transport.encode(q, kv_pool, kv_indptr, kv_indices, kv_lens,
                                              tree_mask, sm_scale, want_lse, request_id,
                                              compact, device, compare_sync, mask_format,
                                              kv_scale=kv_scale)
        try:
            wire = req.SerializeToString()
            resp = self._verify(wire, timeout=self.timeout,
                                metadata=((REQUEST_BYTES_KEY, str(len(wire))),))
        except grpc.RpcError as e:
            # A deadline may pass while verifyd still runs the call: do not reuse its staging.
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                pending.abandon()
            else:
                pending.release()
            raise VerifydError.from_rpc_error(e, self._hint) from None
        except BaseException:
            pending.abandon()
            raise
        return pending.decode(resp)

    def register_kv_pool(self, pool):
        """Registers a serving KV pool (bf16 [num_pages, page_size, 576]) once.

        shm: copies ``pool`` into a new shared-memory region of the client's and returns that
        copy (numpy uint16, or a CPU torch bfloat16 tensor for a torch pool); write new pages into
        the returned array in place and pass it as kv_pool. cuda_ipc: registers the CUDA
        allocation that holds the tensor and returns the tensor itself. Calls then name the pool
        by reference instead of copying the pages they read.
        """
        return self._transport.register_kv_pool(pool)

    def register_buffer(self, tensor):
        """cuda_ipc only: registers the CUDA allocation holding ``tensor`` (e.g. a q buffer the
        caller writes each step) and returns ``tensor``; inputs that live in a registered
        allocation are named in place instead of copied to the device staging slot."""
        return self._transport.register_buffer(tensor)

    def shm_array(self, shape, dtype="uint16"):
        """shm only: a zeroed numpy array in a new registered shared-memory region; any input
        (a pool written in place, q, index arrays) that lives in it is named without a copy."""
        if self.transport != "shm":
            raise ValueError(f"shm_array: needs transport='shm', not '{self.transport}'")
        return self._transport.shm_array(shape, dtype)

    def register_shm_set(self, name, objects):
        """Registers several shared-memory objects as one region set ``name``, e.g. a serving
        process's KV pool of each layer (61 for DeepSeek-V3 / Kimi K2): one registration
        instead of 61, listed as one entry, unregistered with this client's other regions on
        close(). ``objects``: multiprocessing.shared_memory.SharedMemory objects (each whole)
        or (key, offset, byte_size) tuples; member i is objects[i]. A request names a member's
        bytes with ``regions.set_ref(name, i, offset, dtype, shape)``. Any transport (the call
        goes to a Unix socket); each member counts against verifyd's --max_regions and
        --max_regions_per_client. Returns the set as a dict."""
        return self._regions.register_shm_set(name, list(objects), self.client_id)

    def register_cuda_set(self, name, tensors):
        """cuda_ipc only: registers torch CUDA tensors on one GPU (e.g. a serving process's KV
        pool of each layer, 61 for DeepSeek-V3 / Kimi K2) as one region set ``name``: one
        registration instead of 61, listed as one entry, unregistered with this client's other
        regions on close(). Each tensor becomes a member that starts at it: a CUDA IPC handle of
        its cudaMalloc block, or for a tensor in torch's expandable segments
        (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) the chunks behind it, passed as file
        descriptors; the kind is found per tensor. Each member counts against verifyd's
        --max_regions and --max_regions_per_client. Returns a regions.PoolSet: the adapters take
        it with a layer index, and any input inside a member (e.g. ``pools[17]`` as kv_pool) is
        named in place by (set, index). The tensors are kept alive until the set is
        unregistered (``unregister_set``) or the client closes."""
        if self.transport != "cuda_ipc":
            raise ValueError(f"register_cuda_set: needs transport='cuda_ipc', not "
                             f"'{self.transport}'")
        return self._transport.register_set(name, tensors)

    def unregister_set(self, name):
        """Unregisters region set ``name`` (a shm or CUDA set of this client's)."""
        if self.transport == "cuda_ipc":
            return self._transport.forget_set(name)
        return self._regions.unregister(name=name)

    def list_region_sets(self):
        """Every region set registered with verifyd (all clients'), as dicts."""
        return self._regions.list_sets()

    def list_regions(self):
        """Every region registered with verifyd (all clients'), as dicts."""
        return self._regions.list()

    def unregister_regions(self, client):
        """Unregisters every region registered by ``client`` (a client_id); returns the names.

        For regions a crashed process left behind; a live client's close() does this itself.
        """
        return self._regions.unregister(client=client)

    def close(self):
        """Unregisters this client's regions, frees its shared memory, closes the channel."""
        if self._closed:
            return
        self._closed = True
        try:
            for c in self._call_channels:
                c.close()
            self._transport.close()
            if self.transport == "inline":  # the others unregister the client's regions
                self._regions.unregister_client(self.client_id)  # its region sets, if any
        finally:
            super().close()

    def channel(self, byte_size=8 << 20, spin_s=0.002):
        """A CallChannel: ``verify(...)`` through shared memory and a futex doorbell, with no
        gRPC call per verify. Same transport as this client (inline tensors must fit the
        channel's areas: byte_size is split into two); one call at a time, one thread. Needs a
        Unix socket target and x86-64; closed with the client if not before."""
        c = CallChannel(self._stub, self._transport, self.client_id, byte_size, spin_s,
                        self.timeout, self.target)
        self._call_channels.append(c)
        return c

    def doorbell_channel(self, descriptors, layout_slots=2):
        """A DoorbellChannel (doorbell.py): calls a CUDA stream makes, capturable in a CUDA
        graph, each naming one of ``descriptors`` (doorbell.Descriptor). Needs transport
        cuda_ipc; closed with the client if not before."""
        from .doorbell import DoorbellChannel  # noqa: PLC0415 - needs torch

        c = DoorbellChannel(self, descriptors, layout_slots)
        self._call_channels.append(c)
        return c

    def tap_channel(self, backend, max_batch, draft, heads, max_pages, page_size, sm_scale,
                    **kwargs):
        """A TapChannel (tap.py): the serving stack's own attention, tapped after it ran by a
        kernel on its stream that never waits; verifyd compares each sampled call three ways
        (custom, reference, the stack's output). ``backend`` labels the metrics (e.g. "triton",
        "flashinfer_mla", "flashmla"). Needs transport cuda_ipc and libverifyd_tap.so; closed
        with the client if not before."""
        from .tap import TapChannel  # noqa: PLC0415 - needs torch

        c = TapChannel(self, backend, max_batch, draft, heads, max_pages, page_size, sm_scale,
                       **kwargs)
        self._call_channels.append(c)
        return c

    def verify_step(self, kv_pools, max_batch, draft, heads, max_indices, sm_scale, **kwargs):
        """A VerifyStep (doorbell.py): a serving stack's per-layer verify attention, one
        descriptor per layer's KV pool, capturable in a CUDA graph. Needs transport cuda_ipc."""
        from .doorbell import VerifyStep  # noqa: PLC0415 - needs torch

        step = VerifyStep(self, kv_pools, max_batch, draft, heads, max_indices, sm_scale, **kwargs)
        self._call_channels.append(step.channel)
        return step

    def stream(self, timeout=None):
        """A VerifyStream context manager: calls in order over one bidirectional stream."""
        return VerifyStream(self._stub, timeout, self._transport, self._hint)

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
            raise VerifydError.from_rpc_error(e, self._hint) from None
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

    def __init__(self, stub, timeout, transport, hint=None):
        self._transport = transport
        self._hint = hint
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
             want_lse=False, request_id=None, compact=True, device=None, compare_sync=False,
             mask_format=None, kv_scale=None):
        if self._closed:
            raise RuntimeError("VerifyStream: send after close")
        req, pending = self._transport.encode(q, kv_pool, kv_indptr, kv_indices, kv_lens,
                                              tree_mask, sm_scale, want_lse, request_id,
                                              compact, device, compare_sync, mask_format,
                                              kv_scale=kv_scale)
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
            pending.abandon()
            raise VerifydError.from_rpc_error(e, self._hint) from None
        except StopIteration:
            pending.abandon()
            raise VerifydError(grpc.StatusCode.UNAVAILABLE,
                               "stream: verifyd closed the stream") from None
        except BaseException:
            pending.abandon()
            raise
        if resp.error_code != 0:
            pending.release()
            raise VerifydError(status_code(resp.error_code), resp.error_message)
        return pending.decode(resp)

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
                self._drop(1, done=True)
        except grpc.RpcError as e:
            self._drop(len(self._pending), done=False)
            if e.code() != grpc.StatusCode.CANCELLED:
                raise VerifydError.from_rpc_error(e, self._hint) from None
        self._drop(len(self._pending), done=False)

    def cancel(self):
        self._closed = True
        self._requests.put(_END)
        self._call.cancel()
        self._drop(len(self._pending), done=False)

    def _drop(self, n, done):
        """Gives back the staging of the n oldest unanswered calls: for reuse when verifyd
        answered them (``done``), else never reused (verifyd may still run them)."""
        for _ in range(n):
            with self._lock:
                if not self._pending:
                    return
                pending = self._pending.popleft()
            if done:
                pending.release()
            else:
                pending.abandon()
