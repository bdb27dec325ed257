"""Registered regions on verifyd's VerifyService, and the refs that name byte ranges of them.

A client registers a region once (RegisterShmRegion / RegisterCudaRegion) and then names
[offset, offset + byte_size) of it in a Tensor instead of sending the bytes. A region set
(RegisterShmRegionSet) registers several shared-memory objects in one call, e.g. the KV pool of
each layer, and a Tensor names a member by (set, index): ``set_ref``. Regions are served on Unix
sockets (or over TCP with verifyd's --allow_region_tcp).
"""

import os
import uuid

import grpc

from ._proto import types_pb2, verify_pb2
from .errors import VerifydError

DTYPE_SIZE = {types_pb2.DTYPE_BF16: 2, types_pb2.DTYPE_F32: 4, types_pb2.DTYPE_I32: 4,
              types_pb2.DTYPE_U8: 1}
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


def set_ref(region_set, index, offset, dtype, shape):
    """A Tensor naming ``shape`` elements of ``dtype`` at ``offset`` of member ``index`` of the
    shm region set ``region_set``."""
    t = ref("shm", "", offset, dtype, shape)
    t.shm.set, t.shm.index = region_set, int(index)
    return t


def set_member(obj):
    """(key, offset, byte_size) of a region set member: a multiprocessing SharedMemory (the whole
    object), or such a tuple already."""
    if isinstance(obj, tuple):
        key, offset, byte_size = obj
        return str(key), int(offset), int(byte_size)
    return "/" + obj.name.lstrip("/"), 0, int(obj.size)


class RegionCalls:
    """The region calls of one VerifyService stub, raising VerifydError."""

    def __init__(self, stub, timeout):
        self._stub = stub
        self._timeout = timeout
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
            raise VerifydError.from_rpc_error(e) from None

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
        try:
            r = self._call(self._stub.RegisterShmRegionSet, req).set
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
    """A RegionSetInfo as a dict (ListRegions, RegisterShmRegionSet)."""
    kind = types_pb2.RegionKind.Name(s.kind)[len("REGION_KIND_"):].lower()
    return {"name": s.name, "kind": kind, "members": s.members, "byte_size": s.byte_size,
            "client": s.client, "owner": s.owner, "in_use": s.in_use, "calls": s.calls,
            "lost": list(s.lost)}
