"""The one error the filesystem's operations raise."""

from __future__ import annotations


class FsError(Exception):
    """A failed operation: the errno the caller sees."""

    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err
