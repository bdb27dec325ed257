"""Passing file descriptors to verifyd: its descriptor socket (the data socket's path + ".fds").

gRPC cannot carry file descriptors, so the chunks of a CUDA VMM allocation, each exported to a
POSIX file descriptor, go to verifyd over a SOCK_SEQPACKET Unix socket in SCM_RIGHTS, under a
token the client chose (16 random bytes); RegisterCudaVmmRegion then names the token. Each
message carries at most 253 descriptors (the kernel's SCM_MAX_FD) and a 28-byte payload:
"VMFD", the token, and two little-endian u32: the index of its first descriptor in the token's
set and the set's size (src/transport/vmm_fd_payload.h). verifyd answers each message "ok" or
with the error, which names the field. It keeps a set for 60 s, for the uid that sent it only.
"""

import os
import socket
import struct

from .errors import VerifydError

TOKEN_BYTES = 16
FDS_PER_MESSAGE = 253
_MAGIC = b"VMFD"


def socket_path(target):
    """The descriptor socket of verifyd at ``target`` ("unix:PATH" or "unix://PATH"), or None
    for a target that is not a Unix socket."""
    for prefix in ("unix://", "unix:"):
        if target and target.startswith(prefix):
            return target[len(prefix):] + ".fds"
    return None


def new_token():
    return os.urandom(TOKEN_BYTES)


def payload(token, first, total):
    return _MAGIC + token + struct.pack("<II", first, total)


def send(path, token, fds, timeout=10.0):
    """Sends ``fds`` (in order) to verifyd's descriptor socket at ``path`` under ``token``;
    raises VerifydError with verifyd's answer when it refuses a message."""
    import grpc  # noqa: PLC0415 - for the status codes VerifydError carries

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as e:
            raise VerifydError(grpc.StatusCode.UNAVAILABLE,
                               f"cuda_ipc: cannot connect to verifyd's descriptor socket {path}: "
                               f"{e} (verifyd opens it next to its Unix data socket)") from None
        for first in range(0, len(fds), FDS_PER_MESSAGE):
            part = fds[first:first + FDS_PER_MESSAGE]
            socket.send_fds(s, [payload(token, first, len(fds))], part)
            answer = s.recv(1024).decode(errors="replace")
            if answer != "ok":
                raise VerifydError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{answer or 'fds: the connection closed'} (verifyd's "
                                   f"descriptor socket, descriptors {first} to "
                                   f"{first + len(part) - 1} of {len(fds)})")
