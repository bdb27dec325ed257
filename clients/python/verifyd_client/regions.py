"""Registered regions on verifyd's VerifyService, and the refs that name byte ranges of them.

A client registers a region once (RegisterShmRegion / RegisterCudaRegion) and then names
[offset, offset + byte_size) of it in a Tensor instead of sending the bytes. A region set
(RegisterShmRegionSet, RegisterCudaRegionSet) registers several allocations in one call, e.g.
the KV pool of each layer, and a Tensor names a member by (set, index): ``set_ref``. Regions are
served on Unix sockets (or over TCP with verifyd's --allow_region_tcp).
"""

import os
import uuid

import grpc

from ._proto import types_pb2, verify_pb2
from .errors import VerifydError

DTYPE_SIZE = {types_pb2.DTYPE_BF16: 2, types_pb2.DTYPE_F32: 4, types_pb2.DTYPE_I32: 4,
              types_pb2.DTYPE_U8: 1, types_pb2.DTYPE_F8E4M3: 1}
ALIGN = 256  # every tensor a transport places starts on this boundary
OFFSET_GRID = 16  # verifyd refuses a range whose offset is not a multiple of this


def align(n):
    return -(-n // ALIGN) * ALIGN


def client_id():
    """A name that groups one client's regions: unique per process and client object."""
    return f"py-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def ref(kind, region, offset, dtype, shape):
    """A Tensor naming ``shape`` elements of ``dtype`` at ``offset`` of a region.

    kind: "shm" or "cuda_ipc".
    """
    t = types_pb2.Tensor(dtype=dtype, shape=[int(d) for d in shape])
    size = DTYPE_SIZE[dtype]
    for d in shape:
        size *= int(d)
    r = getattr(t, kind)
    r.region, r.offset, r.byte_size = region, int(offset), size
    return t


def set_ref(region_set, index, offset, dtype, shape, kind="shm"):
    """A Tensor naming ``shape`` elements of ``dtype`` at ``offset`` of member ``index`` of the
    region set ``region_set`` (kind "shm" or "cuda_ipc")."""
    t = ref(kind, "", offset, dtype, shape)
    r = getattr(t, kind)
    r.set, r.index = region_set, int(index)
    return t


class PoolSet:
    """A registered region set of tensors, e.g. a serving stack's KV pool of each layer
    (client.register_cuda_set): ``pools[i]`` is member i's tensor, ``kinds[i]`` "cuda_ipc" or
    "vmm", ``info`` the set as verifyd listed it at registration (``set_dict``). The adapters
    take it with a layer index in place of one pool. A PoolSet of tensors that are not
    registered (``PoolSet(name, tensors)``) names its members the same way."""

    def __init__(self, name, tensors, kinds=None, info=None):
        self.name = name
        self.tensors = list(tensors)
        self.kinds = list(kinds) if kinds is not None else [None] * len(self.tensors)
        self.info = info

    def __len__(self):
        return len(self.tensors)

    def __getitem__(self, index):
        return self.tensors[index]

    def layer(self, index):
        """Member ``index``'s tensor; ValueError naming ``layer`` when there is none."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"layer: {index!r} is not an int index into pool set "
                             f"'{self.name}'")
        if not 0 <= index < len(self.tensors):
            raise ValueError(f"layer: {index} is out of range for pool set '{self.name}' "
                             f"({len(self.tensors)} members, 0 to {len(self.tensors) - 1})")
        return self.tensors[index]


def set_member(obj):
    """(key, offset, byte_size) of a region set member: a multiprocessing SharedMemory (the whole
    object), or such a tuple already."""
    if isinstance(obj, tuple):
        key, offset, byte_size = obj
        return str(key), int(offset), int(byte_size)
    return "/" + obj.name.lstrip("/"), 0, int(obj.size)


class RegionCalls:
    """The region calls of one VerifyService stub, raising VerifydError."""

    def __init__(self, stub, timeout, hint=None):
        self._stub = stub
        self._timeout = timeout
        self._hint = hint
        self.registered_any = False  # whether this client ever registered a region

    def unregister_client(self, client):
        """close(): every region of ``client``, if it registered any. A verifyd that is gone
        (UNAVAILABLE) has dropped them itself."""
        if not self.registered_any:
            return []
        try:
            return self.unregister(client=client)
        except VerifydError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                return []
            raise

    def _call(self, method, req):
        try:
            return method(req, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise VerifydError(e.code(), "transport: this verifyd does not serve registered "
                                             "regions; use transport='inline'") from None
            raise VerifydError.from_rpc_error(e, self._hint) from None

    def _register(self, method, req):
        try:
            r = self._call(method, req).region
        except VerifydError as e:
            # Past its deadline the region may have been registered all the same.
            if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self.registered_any = True
            raise
        self.registered_any = True
        return r

    def register_shm(self, name, key, offset, byte_size, client):
        return self._register(self._stub.RegisterShmRegion, verify_pb2.RegisterShmRegionRequest(
            name=name, key=key, offset=offset, byte_size=byte_size, client=client))

    def register_shm_set(self, name, members, client):
        """One registration of several shm objects (``set_member`` of each), named in calls by
        (name, index); returns the set as a dict (``set_dict``)."""
        req = verify_pb2.RegisterShmRegionSetRequest(name=name, client=client)
        for key, offset, byte_size in (set_member(m) for m in members):
            req.members.add(key=key, offset=offset, byte_size=byte_size)
        return self._register_set(self._stub.RegisterShmRegionSet, req)

    def register_cuda_set(self, name, members, device, token, client):
        """One registration of several CUDA allocations on ``device``: ``members`` are dicts
        with ``ipc_handle`` (a CUDA IPC member) or ``chunks`` (a VMM member, whose descriptors
        went to verifyd under ``token``, member by member), ``offset`` and ``byte_size``.
        Returns the set as a dict (``set_dict``)."""
        req = verify_pb2.RegisterCudaRegionSetRequest(name=name, device=device,
                                                      token=token or b"", client=client)
        for m in members:
            req.members.add(ipc_handle=m.get("ipc_handle", b""), chunks=list(m.get("chunks", ())),
                            offset=int(m["offset"]), byte_size=int(m["byte_size"]))
        return self._register_set(self._stub.RegisterCudaRegionSet, req)

    def _register_set(self, method, req):
        try:
            r = self._call(method, req).set
        except VerifydError as e:
            if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                self.registered_any = True
            raise
        self.registered_any = True
        return set_dict(r)

    def register_cuda(self, name, ipc_handle, device, byte_size, client):
        return self._register(self._stub.RegisterCudaRegion,
                              verify_pb2.RegisterCudaRegionRequest(
                                  name=name, ipc_handle=ipc_handle, device=device,
                                  byte_size=byte_size, client=client))

    def register_cuda_vmm(self, name, token, chunks, device, offset, byte_size, client):
        """A VMM allocation's chunks, whose descriptors went to verifyd under ``token``
        (vmm_fds.send), as one cuda_ipc region of ``byte_size`` bytes from ``offset`` into the
        first chunk."""
        return self._register(self._stub.RegisterCudaVmmRegion,
                              verify_pb2.RegisterCudaVmmRegionRequest(
                                  name=name, token=token, chunks=list(chunks), device=device,
                                  offset=offset, byte_size=byte_size, client=client))

    def unregister(self, name="", client=""):
        return list(self._call(self._stub.UnregisterRegion, verify_pb2.UnregisterRegionRequest(
            name=name, client=client)).unregistered)

    def list(self):
        r = self._call(self._stub.ListRegions, verify_pb2.ListRegionsRequest())
        return [region_dict(x) for x in r.regions]

    def list_sets(self):
        r = self._call(self._stub.ListRegions, verify_pb2.ListRegionsRequest())
        return [set_dict(x) for x in r.sets]


def region_dict(r):
    """A RegionInfo as a dict (ListRegions, the admin status)."""
    kind = types_pb2.RegionKind.Name(r.kind)[len("REGION_KIND_"):].lower()
    return {"name": r.name, "kind": kind, "shm_key": r.shm_key, "shm_offset": r.shm_offset,
            "device": r.device, "byte_size": r.byte_size, "client": r.client,
            "in_use": r.in_use, "calls": r.calls, "lost": r.lost, "owner": r.owner}


def set_dict(s):
    """A RegionSetInfo as a dict (ListRegions, RegisterShmRegionSet, RegisterCudaRegionSet)."""
    kind = types_pb2.RegionKind.Name(s.kind)[len("REGION_KIND_"):].lower()
    return {"name": s.name, "kind": kind, "members": s.members, "byte_size": s.byte_size,
            "client": s.client, "owner": s.owner, "in_use": s.in_use, "calls": s.calls,
            "lost": list(s.lost), "device": s.device if kind == "cuda_ipc" else -1,
            "vmm_members": s.vmm_members}
