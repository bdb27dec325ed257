"""A channel's shared-memory object, as every kind of channel (call, doorbell, tap) holds it:
created for verifyd at the target, its 4 KiB header as 32-bit words, optionally registered with
CUDA so that a GPU stream can write it, and opened and closed at verifyd
(src/channel/channel_layout.h)."""

import grpc
import numpy as np

from . import _shm
from ._proto import verify_pb2
from .errors import VerifydError

HEADER_BYTES = 4096
_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class ChannelMemory:
    """``byte_size`` bytes of new shared memory verifyd at ``target`` can open. With ``mapped``,
    registered with CUDA (``dbase``: where a GPU stream writes it)."""

    def __init__(self, byte_size, target, mapped=False):
        self.byte_size = byte_size
        self.shm = _shm.create(byte_size, target)
        self.key = "/" + self.shm.name.lstrip("/")
        self.words = np.frombuffer(self.shm.buf, dtype=np.uint32, count=HEADER_BYTES // 4)
        self.base = self.words.__array_interface__["data"][0]
        self.dbase = None
        self._registered = False
        if not mapped:
            return
        try:
            import torch  # noqa: PLC0415 - mapped memory needs torch with CUDA, the package not

            from . import cuda_driver  # noqa: PLC0415

            rc = torch.cuda.cudart().cudaHostRegister(self.base, byte_size,
                                                      _REGISTER_PORTABLE_MAPPED)
            if int(rc) != 0:
                raise VerifydError(grpc.StatusCode.INTERNAL,
                                   f"cudaHostRegister of the channel's memory: CUDA error {rc}")
            self._registered = True
            self.dbase = cuda_driver.host_device_pointer(self.base)
        except BaseException:
            self.free()
            raise

    def open(self, stub, timeout, **fields):
        """OpenChannel for this memory (``fields``: name, client, descriptors, tap, ...); frees the
        memory (the object is unlinked) and raises VerifydError with verifyd's own status and
        message when verifyd refuses. Take views of ``shm.buf`` only after it returned."""
        try:
            resp = stub.OpenChannel(verify_pb2.OpenChannelRequest(key=self.key,
                                                                  byte_size=self.byte_size,
                                                                  **fields), timeout=timeout)
            # Both sides map the object now: its name goes, so that a client that dies leaves
            # nothing in /dev/shm (the memory lives until the last mapping goes).
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            return resp
        except grpc.RpcError as e:
            self.free()
            raise VerifydError.from_rpc_error(e) from None
        except BaseException:
            self.free()
            raise

    def free(self):
        if self.shm is None:
            return
        if self._registered:
            import torch  # noqa: PLC0415

            torch.cuda.cudart().cudaHostUnregister(self.base)
            self._registered = False
        self.words = None
        shm, self.shm = self.shm, None
        # Unlinked first: the name goes whatever still maps the object.
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        try:
            shm.close()
        except BufferError:
            # A view of the buffer is still held (by the caller's frame, say): the mapping goes
            # with the last view, and the error that brought us here is what the caller sees.
            pass


def close_channel(stub, name, timeout):
    """CloseChannel, when verifyd is still there to hear it (gone, or closed already: nothing to
    do)."""
    try:
        stub.CloseChannel(verify_pb2.CloseChannelRequest(name=name), timeout=timeout)
    except grpc.RpcError:
        pass
