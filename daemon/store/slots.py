"""Slot memory: the expert cache's buffers, one anonymous mmap, optionally mlocked.

``SlotArena`` owns the slot memory for its lifetime; the caller owns the mapping of slots
to experts (the scheduler decides, the streaming provider carries it out) and must not
hand a slot out while a read into it is pending.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource
import threading

from daemon.store.plans import ALIGN, round_up
from telemetry.logs import get_logger

log = get_logger("io")


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


class _Libc:
    """mlock/munlock through ctypes (the stdlib has no wrapper)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mlock, self.munlock = lib.mlock, lib.munlock
        for fn in (self.mlock, self.munlock):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int

    def call(self, fn, addr: int, length: int) -> int:
        """0 on success, else the errno."""
        return 0 if fn(addr, length) == 0 else ctypes.get_errno()


class SlotArena:
    """``n_slots`` expert slots of ``slot_bytes`` bytes each, in one anonymous mmap.

    ``slot_bytes`` is rounded up to a multiple of ALIGN (and of the page size), so every
    slot starts page aligned — usable as an O_DIRECT buffer. With ``lock=True`` the whole
    mapping is ``mlock``-ed; when the kernel refuses (RLIMIT_MEMLOCK too low and no
    CAP_IPC_LOCK) the arena stays pageable, a warning is logged on "moed.io", and
    ``locked`` is False. The arena owns the memory until ``close()``; buffers and arrays
    taken from it must not be used after that.
    """

    def __init__(self, n_slots: int, slot_bytes: int, lock: bool = False):
        if n_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"need n_slots > 0 and slot_bytes > 0, got {n_slots}, {slot_bytes}")
        self.n_slots = n_slots
        self.slot_bytes = round_up(slot_bytes, max(ALIGN, mmap.PAGESIZE))
        self.nbytes = n_slots * self.slot_bytes
        self._mmap = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._mmap)
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._libc = _Libc() if lock else None
        self._released: set[int] = set()  # locked arena: slots munlocked by release()
        self._lock = threading.Lock()
        self.locked = False
        if lock:
            err = self._libc.call(self._libc.mlock, self._addr, self.nbytes)
            if err == 0:
                self.locked = True
            else:
                soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                log.warning("slot_arena_mlock_refused", bytes=self.nbytes, error=os.strerror(err),
                            rlimit_memlock=f"{_limit(soft)}/{_limit(hard)}",
                            effect="slots stay pageable")

    def _range(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.n_slots})")
        return slot * self.slot_bytes, self.slot_bytes

    def buffer(self, slot: int) -> memoryview:
        """The writable ``slot_bytes``-byte memoryview of ``slot`` (page aligned).

        On a locked arena, a slot given back by ``release`` is locked again here (which
        faults its pages in). Raises IndexError for a slot outside the arena.
        """
        start, length = self._range(slot)
        if self.locked:
            with self._lock:
                if slot in self._released:
                    err = self._libc.call(self._libc.mlock, self._addr + start, length)
                    if err:
                        log.warning("slot_arena_mlock_refused", slot=slot, error=os.strerror(err),
                                    effect="slot stays pageable")
                    self._released.discard(slot)
        return self._view[start:start + length]

    def release(self, slot: int) -> None:
        """Give ``slot``'s pages back to the kernel (MADV_DONTNEED; they read as zeros).

        The slot's contents are lost; a locked slot is unlocked first (the kernel refuses
        MADV_DONTNEED on locked pages) and locked again by the next ``buffer(slot)``.
        """
        start, length = self._range(slot)
        with self._lock:
            if self.locked and slot not in self._released:
                self._libc.call(self._libc.munlock, self._addr + start, length)
                self._released.add(slot)
            self._mmap.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        """Unmap the arena. If buffers or arrays over it are still alive, the memory is
        unlocked now and unmapped when the last of them goes away."""
        if self._mmap.closed:
            return
        if self.locked:
            self._libc.call(self._libc.munlock, self._addr, self.nbytes)
            self.locked = False
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            # Arrays over it are still alive: give the pages back now all the same (nothing
            # may read a closed arena), so RSS falls before a rebuild takes its new budget.
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)

    def __enter__(self) -> SlotArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
