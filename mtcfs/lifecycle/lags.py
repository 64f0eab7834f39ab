"""The lags an operator cares about: from a file's close (its seal) to K verified peer
copies, and to persisted in the durable tier. Measured for files sealed here."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode

# Files are tracked from their seal until replicated and persisted; at most this many.
MAX_TRACKED = 100_000


class Lags(Listener):
    def __init__(self, copies: Copies, durable: bool) -> None:
        self.copies = copies
        # Nothing replicates or persists without K or a durable tier: nothing to measure.
        self.measured = bool(copies.replicas) or durable
        self._sealed: dict[int, tuple[int, float]] = {}  # ino -> (version, time sealed)
        self._replicated: set[int] = set()
        self.last_replication: float | None = None
        self.last_persist: float | None = None
        # Observers (metrics): called with the seconds since close.
        self.replication_observers: list[Callable[[float], None]] = []
        self.persist_observers: list[Callable[[float], None]] = []

    def sealed(self, node: Inode) -> None:
        if not self.measured:
            return
        if len(self._sealed) >= MAX_TRACKED:
            self._sealed.pop(next(iter(self._sealed)))
        self._sealed[node.ino] = (node.version, time.monotonic())
        self._replicated.discard(node.ino)

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        seen = self._sealed.get(node.ino)
        if (seen is None or seen[0] != node.version or node.ino in self._replicated
                or not self.copies.replicated(node)):
            return
        self._replicated.add(node.ino)
        lag = self.last_replication = time.monotonic() - seen[1]
        for observe in self.replication_observers:
            observe(lag)
        if node.persisted:
            self._forget(node.ino)

    def persisted(self, node: Inode) -> None:
        seen = self._sealed.get(node.ino)
        if seen is None or seen[0] != node.version:
            return
        lag = self.last_persist = time.monotonic() - seen[1]
        for observe in self.persist_observers:
            observe(lag)
        if node.ino in self._replicated or not self.copies.replicas:
            self._forget(node.ino)

    def removed(self, node: Inode, path: str) -> None:
        self._forget(node.ino)

    def _forget(self, ino: int) -> None:
        self._sealed.pop(ino, None)
        self._replicated.discard(ino)

    def status(self) -> dict[str, object]:
        return {
            "last_replication_lag": self.last_replication,
            "last_persist_lag": self.last_persist,
            "unreplicated_tracked": len(self._sealed) - len(self._replicated),
        }
