"""crc32c of file data: streamed while it is written, or one pass at seal time."""

from __future__ import annotations

import os

import google_crc32c

CHUNK = 4 << 20


class StreamingCrc:
    """Extends a crc32c as long as writes arrive in order from offset 0.

    An out-of-order write, an overwrite or a truncate makes it invalid; the
    file is then checksummed in one pass when it is sealed.
    """

    __slots__ = ("value", "next_off", "valid")

    def __init__(self, value: int = 0, next_off: int = 0, valid: bool = True) -> None:
        self.value = value
        self.next_off = next_off
        self.valid = valid

    def update(self, off: int, buf: bytes) -> None:
        if self.valid:
            if off == self.next_off:
                self.value = google_crc32c.extend(self.value, buf)
                self.next_off += len(buf)
            else:
                self.valid = False

    def truncate(self, size: int) -> None:
        if size == 0:
            self.value, self.next_off, self.valid = 0, 0, True
        elif size != self.next_off:
            self.valid = False

    def result(self, size: int) -> int | None:
        """The crc if the stream covered exactly `size` bytes, else None."""
        return self.value if self.valid and self.next_off == size else None


def crc32c_of_fd(fd: int, size: int) -> int:
    """One pass over the first `size` bytes of `fd` (runs in a worker thread)."""
    crc = 0
    off = 0
    while off < size:
        chunk = os.pread(fd, min(CHUNK, size - off), off)
        if not chunk:
            break
        crc = google_crc32c.extend(crc, chunk)
        off += len(chunk)
    return crc


def crc32c_of_path(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc32c_of_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def format_crc(crc: int | None) -> str | None:
    return None if crc is None else f"{crc:08x}"
