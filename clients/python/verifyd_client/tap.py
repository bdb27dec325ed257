"""Shadow taps: verify the serving stack's own attention on live traffic without ever being
waited for (verify.proto, OpenChannelRequest.tap; src/channel/tap_layout.h).

``client.tap_channel(backend, ...)`` allocates the slots region on the GPU (a control block and a
ring of slots, each with room for one call at the largest shapes), registers it, and opens a tap
channel. After the stack's own attention, ``tap(q, o, kv_pool, kv_indptr, kv_indices, kv_lens,
tree_mask)`` enqueues one small kernel (libverifyd_tap.so, kernels/tap/) on the current stream:

- verifyd decides which calls are sampled (``--shadow_sample_rate``, followed live), through a
  word the kernel reads on the device;
- an unsampled call costs the launch and returns;
- a sampled call copies q, the stack's o, the KV pages the call read and its layout into a free
  slot, and publishes it to verifyd without waiting; with no free slot it is dropped and counted.

Nothing waits on verifyd: the kernel captures into a CUDA graph, and a stopped verifyd only
makes taps drop. The tensors' addresses are taken at each tap() call (for a graph: at capture).
``counts()`` reads the tap's counters: calls, taps (sampled), dropped, and verifyd's compared and
refused; every tap ends compared, refused or dropped, or is still in the ring.
"""

import ctypes
import itertools

import grpc

from . import _native, tensors
from ._channel_memory import HEADER_BYTES, ChannelMemory, close_channel
from ._proto import verify_pb2
from .bundle import HEAD_DIM_QK, HEAD_DIM_V, checked_kv_scale, wire_kv_dtype
from .errors import InvalidBundleError, VerifydError

# Byte offsets of the header's tap words (src/channel/channel_layout.h, static_asserts there).
_PRODUCED_AT, _CONSUMED_AT = 448, 512
_names = itertools.count()


def _torch():
    import torch  # noqa: PLC0415 - taps need torch with CUDA, the package does not
    return torch


class _Args(ctypes.Structure):
    """VerifydTapArgs (kernels/tap/tap_api.h); its size is checked against the library's."""
    _fields_ = [("control", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("records", ctypes.c_void_p), ("header_words", ctypes.c_void_p),
                ("slot_bytes", ctypes.c_uint64), ("o_offset", ctypes.c_uint64),
                ("kv_offset", ctypes.c_uint64), ("record_bytes", ctypes.c_uint64),
                ("mask_row_bytes", ctypes.c_uint64),
                ("slots_n", ctypes.c_uint32), ("max_batch", ctypes.c_uint32),
                ("draft", ctypes.c_uint32), ("heads", ctypes.c_uint32),
                ("max_pages", ctypes.c_uint32), ("page_size", ctypes.c_uint32),
                ("kv_elem_bytes", ctypes.c_uint32), ("kv_scale", ctypes.c_float),
                ("q", ctypes.c_void_p), ("o", ctypes.c_void_p), ("kv_pool", ctypes.c_void_p),
                ("pool_pages", ctypes.c_uint64),
                ("kv_indptr", ctypes.c_void_p), ("kv_indices", ctypes.c_void_p),
                ("kv_lens", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("batch", ctypes.c_uint32), ("grid", ctypes.c_uint32)]


def load_library(path=None):
    """libverifyd_tap.so: ``path``, else $VERIFYD_TAP_LIB, else its installed places."""
    p, lib = _native.load("libverifyd_tap.so", "VERIFYD_TAP_LIB", path, "kernels/tap/")
    lib.verifyd_tap_launch.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p]
    lib.verifyd_tap_launch.restype = ctypes.c_int
    lib.verifyd_tap_args_bytes.restype = ctypes.c_uint32
    lib.verifyd_tap_geometry.argtypes = [ctypes.c_uint32] * 5 + [
        ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]
    if lib.verifyd_tap_args_bytes() != ctypes.sizeof(_Args):
        raise VerifydError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{p}: its VerifydTapArgs has {lib.verifyd_tap_args_bytes()} "
                           f"bytes, this client's {ctypes.sizeof(_Args)}: a library of "
                           f"another verifyd version")
    return lib


class TapChannel:
    """A tap channel of a VerifyClient whose transport is cuda_ipc
    (``client.tap_channel(...)``). One stream taps through it at a time. ``kv_dtype``: the
    stack's KV pool, "bf16" or "e4m3" (torch.float8_e4m3fn, each tap naming its scale); an e4m3
    tap copies half the bytes."""

    def __init__(self, client, backend, max_batch, draft, heads, max_pages, page_size, sm_scale,
                 slots=4, mask_format="bytes", device=None, grid=132, library=None,
                 kv_dtype="bf16"):
        torch = _torch()
        if getattr(client._transport, "kind", None) != "cuda_ipc":  # noqa: SLF001
            raise InvalidBundleError("tap channels need a client with transport='cuda_ipc'")
        if mask_format not in ("bytes", "bits"):
            raise InvalidBundleError(f"mask_format: '{mask_format}', expected 'bytes' or 'bits'")
        if not 1 <= int(grid) <= 1024:
            raise InvalidBundleError(f"grid: {grid} blocks, expected 1 to 1024")
        if kv_dtype not in (tensors.KV_BF16, tensors.KV_E4M3):
            raise InvalidBundleError(f"kv_dtype: {kv_dtype!r}, expected 'bf16' or 'e4m3'")
        self.kv_dtype = kv_dtype
        self._pool_dtype = torch.bfloat16 if kv_dtype == tensors.KV_BF16 else torch.float8_e4m3fn
        kv_elem_bytes = 2 if kv_dtype == tensors.KV_BF16 else 1
        self._lib = load_library(library)
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else int(device))
        self.backend = backend
        self.max_batch, self.draft, self.heads = int(max_batch), int(draft), int(heads)
        self.max_pages, self.page_size = int(max_pages), int(page_size)
        self.slots, self.grid = int(slots), int(grid)
        geo = (ctypes.c_uint64 * 8)()
        self._lib.verifyd_tap_geometry(self.max_batch, self.draft, self.heads, self.max_pages,
                                       self.page_size, int(mask_format == "bits"),
                                       kv_elem_bytes, self.slots, geo)
        slot_bytes, o_offset, kv_offset, record_bytes, mask_row, first_slot, region_bytes = \
            list(geo)[:7]
        self.mask_row_bytes, self.mask_format = int(mask_row), mask_format
        with torch.cuda.device(self.device):
            # Zeroed: no call sampled before verifyd writes its rate, no slot filled.
            self.region = torch.zeros(int(region_bytes), dtype=torch.uint8, device=self.device)
        region, offset = client._transport.register(self.region)  # noqa: SLF001
        area = max(4096, -(-self.slots * int(record_bytes) // 64) * 64)
        byte_size = HEADER_BYTES + 2 * area
        self.name = f"{client.client_id}-tap{next(_names)}"
        self._stub, self.timeout = client._stub, client.timeout  # noqa: SLF001
        self._open = False
        spec = verify_pb2.TapSpec(
            backend=backend, region=region, region_offset=offset, slots=self.slots,
            max_batch=self.max_batch, draft=self.draft, heads=self.heads,
            max_pages=self.max_pages, page_size=self.page_size, sm_scale=float(sm_scale),
            device=self.device.index, kv_dtype=wire_kv_dtype(kv_dtype),
            mask_format=(verify_pb2.MASK_FORMAT_BITS if mask_format == "bits"
                         else verify_pb2.MASK_FORMAT_BYTES))
        self._mem = ChannelMemory(byte_size, client.target, mapped=True)
        resp = self._mem.open(self._stub, self.timeout, name=self.name, client=client.client_id,
                              tap=spec)
        self._words, dbase = self._mem.words, self._mem.dbase
        self._open = True
        assert resp.tap_slot_bytes == slot_bytes and resp.tap_record_bytes == record_bytes
        base = self.region.data_ptr()
        self._args = _Args(control=base, slots=base + int(first_slot),
                           records=dbase + resp.request_offset,
                           header_words=dbase + _PRODUCED_AT, slot_bytes=slot_bytes,
                           o_offset=o_offset, kv_offset=kv_offset, record_bytes=record_bytes,
                           mask_row_bytes=mask_row, slots_n=self.slots,
                           max_batch=self.max_batch, draft=self.draft, heads=self.heads,
                           max_pages=self.max_pages, page_size=self.page_size,
                           kv_elem_bytes=kv_elem_bytes, kv_scale=1.0, grid=self.grid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tap(self, q, o, kv_pool, kv_indptr, kv_indices, kv_lens, tree_mask, kv_scale=None):
        """Enqueues one tap of the call the stack just made, on the current stream: q bf16
        [B*T, H, 576] (or [B*T, H*576]), o the stack's output bf16 [B*T, H, 512] (or 2-D),
        kv_pool [pages, page_size, 576] of the channel's kv_dtype (an e4m3 pool's values being
        e4m3 x ``kv_scale``, this layer's k_scale; None: 1), kv_indptr int32 [B+1], kv_indices
        int32 (the first kv_indptr[B] used, at most max_pages), kv_lens int32 [B] (prefix + T),
        tree_mask uint8 [B, T, T] or bit-packed [B, T, ceil(T/8)] as opened. All contiguous, on
        the channel's device. Never waits; a bad value the kernel sees (a page id past the pool,
        kv_indptr past max_pages or decreasing) makes the fill malformed, which verifyd refuses
        and counts."""
        torch = _torch()
        batch = int(kv_lens.shape[0])
        rows = batch * self.draft
        want = {
            "q": (q, torch.bfloat16, rows * self.heads * HEAD_DIM_QK),
            "o": (o, torch.bfloat16, rows * self.heads * HEAD_DIM_V),
            "kv_indptr": (kv_indptr, torch.int32, batch + 1),
            "kv_lens": (kv_lens, torch.int32, batch),
            "tree_mask": (tree_mask, torch.uint8, rows * self.mask_row_bytes),
        }
        if not 1 <= batch <= self.max_batch:
            raise InvalidBundleError(f"kv_lens: {batch} requests, the tap takes 1 to "
                                     f"{self.max_batch}")
        for name, (t, dtype, n) in want.items():
            _check(name, t, dtype, self.device, n)
        _check("kv_indices", kv_indices, torch.int32, self.device, None)
        _check("kv_pool", kv_pool, self._pool_dtype, self.device, None)
        scale = checked_kv_scale(self.kv_dtype, kv_scale)
        if kv_pool.numel() % (self.page_size * HEAD_DIM_QK):
            raise InvalidBundleError(f"kv_pool: {kv_pool.numel()} elements, not whole pages of "
                                     f"{self.page_size} x {HEAD_DIM_QK}")
        a = self._args
        a.q, a.o, a.kv_pool, a.kv_scale = q.data_ptr(), o.data_ptr(), kv_pool.data_ptr(), scale
        a.pool_pages = kv_pool.numel() // (self.page_size * HEAD_DIM_QK)
        a.kv_indptr, a.kv_indices = kv_indptr.data_ptr(), kv_indices.data_ptr()
        a.kv_lens, a.mask, a.batch = kv_lens.data_ptr(), tree_mask.data_ptr(), batch
        stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self._lib.verifyd_tap_launch(ctypes.byref(a), ctypes.c_void_p(stream))
        if rc != 0:
            raise VerifydError(grpc.StatusCode.INTERNAL, f"tap kernel launch: CUDA error {rc}")

    def tap_args(self, args, o=None):
        """Taps a call given as a backend adapter's VerifyArgs (adapters/: each backend's
        target-verify arguments, converted on the GPU as for verify calls). ``o``: the stack's
        output, when ``args.o`` does not hold it."""
        out = args.o if o is None else o
        if out is None:
            raise InvalidBundleError("o: the stack's output is needed (args.o or o=)")
        if args.mask_format != self.mask_format:
            raise InvalidBundleError(f"tree_mask: {args.mask_format}, the tap was opened for "
                                     f"{self.mask_format}")
        self.tap(args.q, out, args.kv_pool, args.kv_indptr, args.kv_indices, args.kv_lens,
                 args.tree_mask, kv_scale=args.kv_scale)

    def counts(self):
        """The tap's counters: calls, taps (sampled calls), dropped (the ring was full), and
        verifyd's consumed (fills it is done with), compared and refused."""
        w = self._words
        p, c = _PRODUCED_AT // 4, _CONSUMED_AT // 4
        return {"produced": int(w[p]), "calls": int(w[p + 1]), "taps": int(w[p + 2]),
                "dropped": int(w[p + 3]), "consumed": int(w[c]), "compared": int(w[c + 1]),
                "refused": int(w[c + 2])}

    def close(self):
        """Closes the channel at verifyd and frees the shared memory. The stream must have no tap
        of this channel left to run."""
        if self._open:
            self._open = False
            close_channel(self._stub, self.name, self.timeout)
        self._words = None
        self._mem.free()


def _check(name, t, dtype, device, n):
    torch = _torch()
    if not (isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous()):
        raise InvalidBundleError(f"{name}: expected a contiguous torch CUDA tensor")
    if t.dtype != dtype or t.device != device:
        raise InvalidBundleError(f"{name}: {t.dtype} on {t.device}, expected {dtype} on {device}")
    if n is not None and t.numel() != n:
        raise InvalidBundleError(f"{name}: {t.numel()} elements, expected {n}")


__all__ = ["TapChannel", "load_library"]
