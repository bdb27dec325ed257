"""A client's staging slots: buffers in registered regions that one call at a time owns.

Each call in flight (a unary call, or a stream call between send and recv) holds its own slot, so
pipelined calls never overwrite each other's inputs or outputs; a slot goes back to the ring
when its answer has been read. A slot too small for a call is replaced by a larger one.
"""

import threading

from .regions import align


class Layout:
    """Byte offsets of named tensors packed one after another, each aligned to ALIGN."""

    def __init__(self):
        self.offsets = {}
        self.size = 0

    def add(self, name, nbytes):
        self.offsets[name] = self.size
        self.size += align(max(int(nbytes), 1))
        return self.offsets[name]


class SlotRing:
    """Up to ``max_slots`` slots made by ``make_slot(nbytes)``; each has ``.size``, ``.close()``
    (idle: free it) and ``.retire()`` (verifyd may still use it: free it only when verifyd is
    done). acquire() raises RuntimeError when all are held (too many calls in flight)."""

    MIN_SLOT_BYTES = 1 << 20

    def __init__(self, make_slot, max_slots):
        if max_slots < 1:
            raise ValueError(f"staging_slots: {max_slots} must be >= 1")
        self._make = make_slot
        self._max = max_slots
        self._free = []
        self._held = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes):
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif self._held < self._max:
                slot = None
            else:
                raise RuntimeError(
                    f"staging: all {self._max} slots are held by calls in flight; recv() answers "
                    f"first or create the client with more staging_slots")
            self._held += 1
        try:
            if slot is not None and slot.size < nbytes:
                slot.close()
                slot = None
            if slot is None:
                want = max(self.MIN_SLOT_BYTES, nbytes)
                slot = self._make(1 << (want - 1).bit_length())  # a power of two: regrow rarely
        except BaseException:
            with self._lock:
                self._held -= 1
            raise
        return slot

    def release(self, slot):
        """The slot's call is over: verifyd no longer reads or writes it."""
        with self._lock:
            self._held -= 1
            self._free.append(slot)

    def retire(self, slot):
        """The slot's call may still run in verifyd (a cancelled stream): never reuse it."""
        with self._lock:
            self._held -= 1
        slot.retire()

    def close(self, **how):
        """Closes the free slots (``how`` goes to their close())."""
        with self._lock:
            free, self._free = self._free, []
        for slot in free:
            slot.close(**how)

    def held(self):
        with self._lock:
            return self._held
