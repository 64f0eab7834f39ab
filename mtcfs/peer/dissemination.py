"""Getting this host's index changes to every peer, and knowing when they arrived.

Changes go out in batches on one ordered queue per peer; a peer's reply to a
batch means it has applied it (the receiver applies before it answers), so
each queue counts what was enqueued and what was acknowledged. `wait_applied`
is the commit rule: fsync, a directory fsync and the rename or close that
commits a step return only once every live peer has applied everything this
host published before the call (bounded by --commit-timeout).

"Every live peer" counts peers that are alive and peers that were configured
but are not known to be dead yet (never reached, or failing fewer than the
dead threshold): a fresh mount does not treat a peer that has not answered
yet as absent.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

MAX_BATCH = 500  # entries per broadcast: each batch is applied in one go
MAX_QUEUE = 200_000  # a peer away this long catches up from a snapshot instead


class SendFailed(Exception):
    """The batch did not reach the peer (it is marked failed by the sender)."""


@dataclass
class _Queue:
    entries: deque[pb.Entry] = field(default_factory=deque)
    enqueued: int = 0  # entries ever put on the queue
    acked: int = 0  # entries the peer has applied (a prefix of the queue's history)
    sending: bool = False
    epoch: int = 0  # bumped when the queue is dropped (the peer catches up otherwise)


@dataclass
class Stats:
    batches_sent: int = 0
    entries_sent: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    max_wait: float = 0.0
    timeouts: int = 0
    last_timeout: str = ""  # the peers that did not answer in time, as logged


class Broadcaster:
    def __init__(self, members: Membership, send: Callable[[Peer, list[pb.Entry]],
                                                           Awaitable[None]],
                 commit_timeout: float) -> None:
        self.members = members
        self._send = send  # raises SendFailed
        self.commit_timeout = commit_timeout
        self.stats = Stats()
        self._queues: dict[str, _Queue] = {}
        self._wake = trio.Event()
        self._progress = trio.Event()  # set on every ack and every membership change
        self._nursery: trio.Nursery | None = None
        # Observers (metrics): seconds a commit waited; a commit that timed out.
        # Observers (metrics): called with the seconds a commit waited.
        self.observers: list[Callable[[float], None]] = []
        self.on_timeout: Callable[[], None] = lambda: None

    # -- publishing --------------------------------------------------------------------

    def publish(self, entries: list[pb.Entry]) -> None:
        """Queue entries for every configured peer (dead ones get them when back)."""
        if not entries:
            return
        for addr in self.members.peers:
            q = self._queues.setdefault(addr, _Queue())
            if len(q.entries) + len(entries) > MAX_QUEUE:
                # Away for too long: it catches up from a snapshot when it is back.
                q.entries.clear()
                q.acked = q.enqueued
                q.epoch += 1
            q.entries.extend(entries)
            q.enqueued += len(entries)
        self._wake.set()

    def pending(self) -> int:
        return sum(len(q.entries) for q in self._queues.values())

    def quiet(self) -> bool:
        """Nothing waiting for a live peer."""
        return not any(self._queues.get(p.addr) and self._queues[p.addr].entries
                       for p in self.members.live())

    def drained(self, p: Peer) -> bool:
        q = self._queues.get(p.addr)
        return q is None or (not q.entries and not q.sending)

    def kick(self) -> None:
        """Membership changed (a peer is alive or dead): send, and re-check waiters."""
        self._wake.set()
        self._notify()

    def _notify(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # -- the commit rule -----------------------------------------------------------------

    def counted(self, p: Peer) -> bool:
        """A peer a commit waits for: alive, or configured and not known dead yet."""
        return not p.removed and (p.alive or not p.known_dead)

    async def wait_applied(self, what: str) -> list[str]:
        """Return once every counted peer has applied everything published so far, or
        after the commit timeout; returns the peers that did not answer (logged)."""
        marks = {addr: q.enqueued for addr, q in self._queues.items()}
        if not any(q.enqueued > q.acked for q in self._queues.values()):
            return []  # everything already applied everywhere: the common case is free
        t0 = time.monotonic()
        self._wake.set()
        missing: list[Peer] = []
        with trio.move_on_after(self.commit_timeout):
            while True:
                missing = self._missing(marks)
                if not missing:
                    break
                await self._progress.wait()
        missing = self._missing(marks)
        took = time.monotonic() - t0
        self.stats.waits += 1
        self.stats.wait_seconds += took
        self.stats.max_wait = max(self.stats.max_wait, took)
        for observe in self.observers:
            observe(took)
        if not missing:
            return []
        names = [f"{p.node_id or '?'} ({p.addr})" for p in missing]
        self.stats.timeouts += 1
        self.stats.last_timeout = ", ".join(names)
        self.on_timeout()
        log.error("%s: returned after --commit-timeout %.1f s; these peers did not answer "
                  "and may not see it yet: %s", what, self.commit_timeout, ", ".join(names))
        return names

    def _missing(self, marks: dict[str, int]) -> list[Peer]:
        out = []
        for addr, mark in marks.items():
            p = self.members.peers.get(addr)
            q = self._queues.get(addr)
            if p is None or q is None or not self.counted(p):
                continue
            if q.acked < mark:
                out.append(p)
        return out

    # -- sending -------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                for addr, q in list(self._queues.items()):
                    p = self.members.peers.get(addr)
                    if p is None:
                        del self._queues[addr]
                        self._notify()
                    elif q.entries and not q.sending and p.alive:
                        q.sending = True
                        nursery.start_soon(self._flush, p, q)

    async def _flush(self, p: Peer, q: _Queue) -> None:
        try:
            while p.alive and not p.removed and q.entries:
                batch = [q.entries[i] for i in range(min(MAX_BATCH, len(q.entries)))]
                epoch = q.epoch
                try:
                    await self._send(p, batch)
                except SendFailed:
                    await trio.sleep(0.2)
                    continue
                if q.epoch == epoch:  # else the queue was dropped meanwhile
                    for _ in batch:
                        q.entries.popleft()
                    q.acked += len(batch)
                self.stats.batches_sent += 1
                self.stats.entries_sent += len(batch)
                self._notify()
        finally:
            q.sending = False
            if q.entries and p.alive:
                self._wake.set()

    def status(self) -> dict[str, object]:
        s = self.stats
        return {
            "commit_timeout": self.commit_timeout,
            "waits": s.waits,
            "wait_seconds": round(s.wait_seconds, 3),
            "max_wait_seconds": round(s.max_wait, 3),
            "timeouts": s.timeouts,
            "last_timeout": s.last_timeout or None,
            "broadcast_queue": self.pending(),
        }
