"""When the trainer last wrote: replication and receives yield to a save in progress.

The filesystem is its one writer: each write it serves, and, with passthrough
(whose writes it does not see), each open and release of a file for writing.
While a passthrough writer has a file open, the clock looks at that file's RAM
copy (size and mtime, one stat per file): when they moved since the last look,
the trainer is writing now. The peer tier reads it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import trio


class WriteClock:
    def __init__(self, stat_ram_file: Callable[[int], os.stat_result] | None = None) -> None:
        """`stat_ram_file(ino)`: the RAM tier's data file of a file (mtcfs.tiers.ram)."""
        self._last = 0.0
        self._stat = stat_ram_file
        self._writing: dict[int, tuple[int, int]] = {}  # ino -> (size, mtime) last seen
        self._opened = trio.Event()  # a passthrough writer came (see writer_open)

    def wrote(self) -> None:
        self._last = time.monotonic()

    def passthrough_opened(self, ino: int) -> None:
        """A file was opened for writing through passthrough: watched until released."""
        self.wrote()
        self._writing.setdefault(ino, (-1, -1))
        self._opened.set()

    def passthrough_writers(self) -> int:
        """Files open for writing through passthrough now."""
        return len(self._writing)

    async def writer_open(self) -> None:
        """Return once a file is open for writing through passthrough (at once if one
        is): what watches those writes sleeps, not polls, while there are none."""
        while not self._writing:
            self._opened = trio.Event()
            await self._opened.wait()

    def passthrough_released(self, ino: int, writers_left: int) -> None:
        if not writers_left:
            self._writing.pop(ino, None)

    def last_write(self) -> float:
        """time.monotonic() of the trainer's last write (0: none yet)."""
        if self._writing and self._stat is not None:
            for ino, seen in list(self._writing.items()):
                try:
                    st = self._stat(ino)
                except OSError:
                    continue
                now = (st.st_size, st.st_mtime_ns)
                if now != seen:
                    self._writing[ino] = now
                    self._last = time.monotonic()
        return self._last
