"""RAM files read through a mapping, and the shrinks that must wait for them.

On a tmpfs with huge pages, reading a RAM file where it lies costs less than
copying it into a buffer first: a seal's checksum pass, and the sending end of a
transfer on the data channel (it tags and sends each block from the mapping),
measured in docs/benchmarks.md. But a mapped page past the file's end is SIGBUS,
which kills the daemon, and a hole touched through a mapping allocates a page. So
the file system never shrinks a file, nor punches a hole in it, while a mapping of
it is in use: a shrink waits for them (a pass or a transfer takes well under a
second per GiB), and a mapping asked for during a shrink is refused (the caller
reads with system calls instead, whose faults are errors, not signals).

One lock, any thread: pins are taken in the trio thread or in workers, released in
workers; a shrink waits in the trio thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable

import trio

from mtcfs.core.checksums import map_read_only, next_hole

SHRINK_POLL = 0.005  # a waiting shrink looks again this often (shrinks are rare)


class Pin:
    """One mapping's claim on a file: `mapped` says whether the holder may map it;
    release() once the mapping is no longer touched (any thread, once)."""

    def __init__(self, mapped: bool, release: Callable[[], None]) -> None:
        self.mapped = mapped
        self._release = release
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            release, self._release = self._release, _nothing
        release()


def _nothing() -> None:
    pass


NOT_MAPPED = Pin(False, _nothing)  # read and write with system calls


class MappedFiles:
    """`enabled`: mappings are worth it here (a tmpfs of this daemon's own with huge
    pages: with small pages, faulting them in costs more than copying)."""

    def __init__(self, enabled: Callable[[], bool]) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._pins: Counter[int] = Counter()  # ino -> mappings in use
        self._shrinking: Counter[int] = Counter()  # ino -> shrinks under way

    @property
    def enabled(self) -> bool:
        return self._enabled()

    def pin(self, ino: int) -> Pin:
        """A claim to map the RAM file of `ino` (not granted while it is being shrunk,
        or where mappings are off): no shrink or punched hole until it is released."""
        if not self._enabled():
            return NOT_MAPPED
        with self._lock:
            if self._shrinking[ino]:
                return NOT_MAPPED
            self._pins[ino] += 1
        return Pin(True, lambda: self._unpin(ino))

    def _unpin(self, ino: int) -> None:
        with self._lock:
            self._pins[ino] -= 1
            if self._pins[ino] <= 0:
                del self._pins[ino]

    def in_use(self, ino: int) -> bool:
        with self._lock:
            return self._pins[ino] > 0

    @contextlib.asynccontextmanager
    async def shrinking(self, ino: int) -> AsyncIterator[None]:
        """Around a shrink of the RAM file of `ino` or a hole punched in it: no new
        mapping from here on, and the ones in use are waited for."""
        with self._lock:
            self._shrinking[ino] += 1
        try:
            while self.in_use(ino):
                await trio.sleep(SHRINK_POLL)
            yield
        finally:
            with self._lock:
                self._shrinking[ino] -= 1
                if self._shrinking[ino] <= 0:
                    del self._shrinking[ino]


def map_range(fd: int, start: int, end: int) -> memoryview | None:
    """map_read_only of bytes [start, end) of the open file fd, or None where the file
    ends before `end` or has a hole in the range. Only under a pin: checked here, a
    shrink later would still be SIGBUS."""
    try:
        if os.fstat(fd).st_size < end or next_hole(fd, start, end) < end:
            return None
    except OSError:
        return None
    return map_read_only(fd, start, end)
