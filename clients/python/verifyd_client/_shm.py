"""Who may open the client's POSIX shared-memory objects (shm regions, call channels).

multiprocessing.shared_memory creates an object 0600; a verifyd that runs as another user (the
systemd unit and the DaemonSet do, with the serving stack's user in verifyd's group) could not
open it. So each object is given to the group of verifyd's data socket, read-write (0660), when
that socket admits its group and this process is in it: the same users may then open the object
as may call verifyd. verifyd still maps an object only for the uid that owns it (SO_PEERCRED),
so another member of the group cannot have verifyd read or write it.
"""

import os
import stat
from multiprocessing import shared_memory


def socket_group(target):
    """The group that may call verifyd at ``target``: for "unix:PATH" or "unix://PATH" the
    socket's group when the socket is group-writable; None for anything else (TCP, an abstract
    socket, a socket only its owner may use, a path this process cannot stat)."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            path = target[len(prefix):]
            break
    else:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or not st.st_mode & stat.S_IWGRP:
        return None
    return st.st_gid


def create(size, target):
    """A new SharedMemory of ``size`` bytes that verifyd at ``target`` can open. Where this
    process may not give it the socket's group it stays 0600, and verifyd's refusal to open it
    says so when it runs as another user."""
    shm = shared_memory.SharedMemory(create=True, size=size)
    group = socket_group(target)
    if group is None:
        return shm
    fd = shm._fd  # noqa: SLF001 - SharedMemory keeps its descriptor open
    try:
        os.fchown(fd, -1, group)
    except PermissionError:
        return shm
    try:
        # fchmod, not the creation mode: the umask would take the group's bits away.
        os.fchmod(fd, 0o660)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm
