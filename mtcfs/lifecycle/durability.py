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
from typing import TYPE_CHECKING

import trio

from mtcfs.lifecycle.copies import Copies

if TYPE_CHECKING:
    from mtcfs.fs.filesystem import Filesystem
    from mtcfs.fs.namespace import Inode
    from mtcfs.persist.steps import StepRules

log = logging.getLogger(__name__)

LOCAL, REPLICAS, GCS = "local", "replicas", "gcs"


class NotDurable(OSError):
    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class Durability:
    def __init__(self, fs: Filesystem, copies: Copies, rules: StepRules, level: str,
                 timeout: float) -> None:
        self.fs = fs
        self.copies = copies
        self.rules = rules
        self.level = level
        self.timeout = timeout
        self.waits: dict[str, int] = {}
        self.wait_seconds: dict[str, float] = {}
        self.failures = 0
        self.waiting: dict[int, int] = {}  # ino -> fsyncs waiting on it (pushed first)
        self.on_waited: Callable[[str, float], None] = lambda level, seconds: None
        self._lot = trio.lowlevel.ParkingLot()

    def changed(self) -> None:
        """A file gained a copy or was persisted."""
        self._lot.unpark_all()

    def level_for(self, node: Inode) -> str:
        level = self.level
        if level == GCS and (self.fs.uploader is None or self.rules.is_temporary(self.fs.ns, node)):
            level = REPLICAS if self.copies.replicas and self.fs.peers is not None else LOCAL
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
        if level == GCS and self.fs.uploader is not None:
            self.fs.uploader.request([node])  # whatever the persist policy says
        t0 = time.monotonic()
        version = node.version
        self.waiting[node.ino] = self.waiting.get(node.ino, 0) + 1
        try:
            with trio.move_on_after(self.timeout):
                while not self.reached(node, level):
                    if node.version != version or node.dirty:
                        break  # rewritten meanwhile: this fsync's data is superseded
                    with trio.move_on_after(0.5):  # also re-check without a wake-up
                        await self._lot.park()
        finally:
            n = self.waiting.pop(node.ino, 1) - 1
            if n > 0:
                self.waiting[node.ino] = n
        took = time.monotonic() - t0
        self.waits[level] = self.waits.get(level, 0) + 1
        self.wait_seconds[level] = self.wait_seconds.get(level, 0.0) + took
        self.on_waited(level, took)
        if self.reached(node, level) or node.version != version or node.dirty:
            return
        self.failures += 1
        path = self.fs.ns.path_of(node)
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
