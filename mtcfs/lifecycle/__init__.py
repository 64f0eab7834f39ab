"""The RAM tier's lifecycle (DESIGN.md, "File lifecycle"): what stays in
memory, what leaves and when, and how durable an fsync is.

- `copies`: where a file's copies are; whether this host's copy may go.
- `space`: eviction under pressure, writers waiting for space, ENOSPC.
- `retention`: --keep-steps, stale incomplete steps.
- `durability`: --fsync local|replicas|gcs.

`Lifecycle` ties them to the filesystem's events (seal, replica, persist) and
measures the lags an operator cares about: close -> K replicas, close -> persisted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtcfs.lifecycle.copies import Copies
from mtcfs.lifecycle.durability import Durability
from mtcfs.lifecycle.retention import Retention
from mtcfs.lifecycle.space import SpaceManager
from mtcfs.lifecycle.withdrawal import Withdrawal

if TYPE_CHECKING:
    import trio

    from mtcfs.config import MountOptions
    from mtcfs.fs.filesystem import Filesystem
    from mtcfs.fs.namespace import Inode
    from mtcfs.persist.steps import StepRules

# Lags are measured for files sealed here, and forgotten after this many.
MAX_TRACKED = 100_000


class Lifecycle:
    def __init__(self, fs: Filesystem, opts: MountOptions, rules: StepRules) -> None:
        peers = fs.peers
        replicas = (opts.replicas or 0) if peers is not None else 0
        is_live: Callable[[str], bool] = (
            (lambda n: peers.members.by_node(n) is not None) if peers is not None
            else (lambda n: False))
        self.fs = fs
        self.copies = Copies(fs.node_id, replicas, is_live, durable=fs.uploader is not None)
        self.space = SpaceManager(fs, self.copies, rules, opts.keep_steps, opts.full_timeout)
        self.space.can_become_safe = self._can_become_safe
        self.durability = Durability(fs, self.copies, rules, opts.fsync, opts.fsync_timeout)
        self.retention = (Retention(fs, self.space, opts.keep_steps, opts.incomplete_grace)
                          if opts.keep_steps else None)
        # With peers, a committed step whose file lost its last copy is withdrawn.
        self.withdrawal = (Withdrawal(fs, self.copies, rules,
                                      lambda: [p.node_id for p in peers.members.live()])
                           if peers is not None else None)
        # (version, time sealed) of files sealed here, until replicated/persisted.
        self._sealed: dict[int, tuple[int, float]] = {}
        self._replicated: set[int] = set()
        # Observers of lags (metrics): called with seconds since close.
        self.on_replication_lag: Callable[[float], None] = lambda s: None
        self.on_persist_lag: Callable[[float], None] = lambda s: None
        self.last_replication_lag: float | None = None
        self.last_persist_lag: float | None = None

    async def run(self, nursery: trio.Nursery) -> None:
        if self.retention is not None:
            nursery.start_soon(self.retention.run)
        if self.fs.ram.own_tmpfs:
            nursery.start_soon(self.space.keep_room, self.fs.write_headroom)
        if self.withdrawal is not None:
            nursery.start_soon(self.withdrawal.run)

    def _can_become_safe(self) -> bool:
        fs = self.fs
        if fs.uploader is not None and not fs.uploader.idle():
            return True
        # Replication in flight or queued (a refused replica is retried every 10 s).
        return bool(fs.peers is not None and self.copies.replicas
                    and fs.peers.members.live() and not fs.peers.quiet())

    # -- events from the tiers ---------------------------------------------------------

    def on_sealed(self, node: Inode) -> None:
        if not self.copies.replicas and self.fs.uploader is None:
            return  # no lag to measure: nothing will replicate or persist it
        if len(self._sealed) >= MAX_TRACKED:
            self._sealed.pop(next(iter(self._sealed)))
        self._sealed[node.ino] = (node.version, time.monotonic())
        self._replicated.discard(node.ino)
        self._kick()

    def on_copies(self, node: Inode) -> None:
        """The node gained (or lost) a copy on a peer."""
        seen = self._sealed.get(node.ino)
        if (seen is not None and seen[0] == node.version and node.ino not in self._replicated
                and self.copies.replicated(node)):
            self._replicated.add(node.ino)
            lag = time.monotonic() - seen[1]
            self.last_replication_lag = lag
            self.on_replication_lag(lag)
            if node.persisted:
                self._forget(node.ino)
        self._kick()

    def on_persisted(self, node: Inode) -> None:
        seen = self._sealed.get(node.ino)
        if seen is not None and seen[0] == node.version:
            lag = time.monotonic() - seen[1]
            self.last_persist_lag = lag
            self.on_persist_lag(lag)
            if node.ino in self._replicated or not self.copies.replicas:
                self._forget(node.ino)
        self._kick()

    def on_freed(self) -> None:
        self.space.changed()

    def _forget(self, ino: int) -> None:
        self._sealed.pop(ino, None)
        self._replicated.discard(ino)

    def on_peers_changed(self) -> None:
        """A peer came or went (its copies count, or no longer do), or a remote change
        arrived (holders may have dropped a copy)."""
        if self.withdrawal is not None:
            self.withdrawal.kick()

    def _kick(self) -> None:
        self.space.changed()
        self.durability.changed()
        if self.retention is not None:
            self.retention.kick()

    def status(self) -> dict[str, object]:
        return {
            **self.space.status(),
            "fsync": self.durability.status(),
            "incomplete_grace": self.retention.grace if self.retention else None,
            "removed_incomplete_steps": self.retention.removed_steps[-20:]
            if self.retention else [],
            "last_replication_lag": self.last_replication_lag,
            "last_persist_lag": self.last_persist_lag,
            "unreplicated_tracked": len(self._sealed) - len(self._replicated),
            **(self.withdrawal.status() if self.withdrawal is not None else {}),
        }
