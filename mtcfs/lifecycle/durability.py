"""Durability per fsync (--fsync local|replicas|gcs).

`fsync()` (and `close()` of a file opened with O_SYNC) returns once the file's
current version is in RAM (local), in K verified peer copies (replicas), or
persisted (gcs). The kernel turns every write() on an O_SYNC file into an
fsync as well; those get `local`, so the level is paid once, at close.

Files under a temporary name (`*.tmp`, an Orbax tmp dir) are never uploaded:
at level gcs they wait for K replicas when peers are configured, else only for
RAM. A level that is not reached within --fsync-timeout fails the call with
EIO (and a log line saying what was missing).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode, Namespace
    from mtcfs.core.steps import StepRules

log = logging.getLogger(__name__)

LOCAL, REPLICAS, GCS = "local", "replicas", "gcs"


class NotDurable(OSError):
    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class Persister(Protocol):
    """The durable tier's uploads (mtcfs.persist.uploader)."""

    def request(self, nodes: list[Inode]) -> tuple[int, int]:
        """Persist these files now, whatever the policy."""
        ...

    def persists(self, node: Inode) -> bool:
        """The file is ever uploaded (there is a durable tier, and it is not under a
        temporary name)."""
        ...


class Durability(Listener):
    """fsync's level. `persister`: the uploads (absent.NoUploader without a durable
    tier); `peers`: whether peers are configured (level gcs falls back to replicas for
    files never uploaded)."""

    def __init__(self, ns: Namespace, copies: Copies, events: Listener, rules: StepRules,
                 level: str, timeout: float, persister: Persister,
                 peers: bool) -> None:
        self.ns = ns
        self.copies = copies
        self.events = events  # fsync_waiting: the peer tier pushes those files first
        self.rules = rules
        self.level = level
        self.timeout = timeout
        self.persister = persister
        self.peers = peers
        self.waits: dict[str, int] = {}
        self.wait_seconds: dict[str, float] = {}
        self.failures = 0
        # Observer (metrics): called with the level and the seconds an fsync waited.
        self.observers: list[Callable[[str, float], None]] = []
        self._lot = trio.lowlevel.ParkingLot()

    # -- events (Listener) -------------------------------------------------------------

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        self._lot.unpark_all()

    def persisted(self, node: Inode) -> None:
        self._lot.unpark_all()

    # -- the level ---------------------------------------------------------------------

    def level_for(self, node: Inode) -> str:
        level = self.level
        if level == GCS and not self.persister.persists(node):
            level = REPLICAS if self.copies.replicas and self.peers else LOCAL
        return level

    def reached(self, node: Inode, level: str) -> bool:
        if level == LOCAL or not node.linked:
            return True
        if node.persisted:
            return True  # persisted is at least as durable as K replicas
        if level == REPLICAS:
            return self.copies.replicated(node)
        return False

    async def wait(self, node: Inode) -> None:
        """Return once the node's current version reached the configured level."""
        level = self.level_for(node)
        if self.reached(node, level):
            return
        if level == GCS:
            self.persister.request([node])  # whatever the persist policy says
        t0 = time.monotonic()
        version = node.version
        self.events.fsync_waiting(node, True)
        try:
            with trio.move_on_after(self.timeout):
                while not self.reached(node, level):
                    if node.version != version or node.dirty:
                        break  # rewritten meanwhile: this fsync's data is superseded
                    with trio.move_on_after(0.5):  # also re-check without a wake-up
                        await self._lot.park()
        finally:
            self.events.fsync_waiting(node, False)
        took = time.monotonic() - t0
        self.waits[level] = self.waits.get(level, 0) + 1
        self.wait_seconds[level] = self.wait_seconds.get(level, 0.0) + took
        for observe in self.observers:
            observe(level, took)
        if self.reached(node, level) or node.version != version or node.dirty:
            return
        self.failures += 1
        path = self.ns.path_of(node)
        have = ("persisted" if node.persisted else
                f"{self.copies.replicas_of(node)} of {self.copies.replicas} peer copies")
        msg = f"fsync {path}: level {level} not reached in {self.timeout:.0f} s ({have})"
        log.error("%s", msg)
        raise NotDurable(msg)

    def status(self) -> dict[str, object]:
        return {
            "level": self.level,
            "timeout": self.timeout,
            "waits": dict(self.waits),
            "wait_seconds": {k: round(v, 3) for k, v in self.wait_seconds.items()},
            "failures": self.failures,
        }
