"""When the trainer last wrote: replication and receives yield to a save in progress.

The filesystem is its one writer (each write it serves; with passthrough, which it
does not see, each open and close of a file for writing); the peer tier reads it.
"""

from __future__ import annotations

import time


class WriteClock:
    def __init__(self) -> None:
        self._last = 0.0

    def wrote(self) -> None:
        self._last = time.monotonic()

    def last_write(self) -> float:
        """time.monotonic() of the trainer's last write (0: none yet)."""
        return self._last
