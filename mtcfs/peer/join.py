"""Joining the job and catching up: snapshots pulled from other hosts (whole, or
what changed while this host saw them dead), applied as their pieces arrive."""

from __future__ import annotations

import logging
import random
import sqlite3
import time

import grpc
import trio

from mtcfs.core.store import MetaStore
from mtcfs.peer.catchup import Pulled
from mtcfs.peer.index import applying_snapshot, first_hand
from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.outbox import Outbox
from mtcfs.peer.remote import RemoteChanges
from mtcfs.peer.replicator import PeerSettings, Transfers
from mtcfs.peer.security import BadRequest, check_batch, check_entry
from mtcfs.peer.stats import Stats
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT = 60.0
MAX_BATCH = 500  # snapshot entries applied per slice (FUSE is served between slices)
ROWS_PER_SLICE = 2_000  # rows left for later written per slice (about 15 ms here)
LATER_RETRY = 5.0  # seconds before rows the store could not take are tried again


class LaterRows:
    """Writes the rows that pulls left for later (MetaStore.write_behind) once no
    pull is under way, in slices with FUSE served between them: a joining host is
    live with its index in memory, its store complete a second or two later."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self._wake = trio.Event()

    def poke(self) -> None:
        """A pull ended: its rows are to be written."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            t0, rows = time.monotonic(), self.store.rows_later
            while self.store.rows_later and not self.store.deferring:
                try:
                    self.store.write_later(ROWS_PER_SLICE)
                except sqlite3.Error as e:  # the RAM dir full: the rows wait, no crash
                    log.warning("storing index rows left for later: %s; again in %.0f s",
                                e, LATER_RETRY)
                    await trio.sleep(LATER_RETRY)
                await trio.sleep(0)
            if rows and not self.store.rows_later:
                log.info("stored the %d index rows pulled snapshots left for later in "
                         "%.1f s", rows, time.monotonic() - t0)


class SnapshotPuller:
    def __init__(self, members: Membership, remote: RemoteChanges, outbox: Outbox,
                 stats: Stats, settings: PeerSettings, transfers: Transfers,
                 later: LaterRows) -> None:
        """`remote`: where pulled entries are applied; `outbox`: where they are
        republished down the tree (a catch-up for this host's side); `later`: writes
        the index rows a pull leaves for later."""
        self.members = members
        self.remote = remote
        self.later = later
        self.outbox = outbox
        self.stats = stats
        self.node_id = settings.node_id
        self.listen = settings.listen
        self.transfers = transfers

    async def catch_up(self, p: Peer) -> bool:
        """Pull `p`'s whole snapshot (a host starting)."""
        return (await self.pull(p, 0.0)).ok

    async def pull(self, p: Peer, since: float = 0.0, republish: bool = False) -> Pulled:
        """Pull `p`'s snapshot (since > 0: what changed there in the last `since`
        seconds, if it can tell; else all of it), applying its pieces as they arrive
        (the source makes the next while this host applies one), and publishing them
        down the tree too if `republish` (this host catches up for its side:
        mtcfs.peer.catchup). Not ok: the pull failed (what arrived is applied: every
        entry is a state merged by its stamp, any subset is sound)."""
        send, recv = trio.open_memory_channel[list[pb.Entry]](4)
        token = trio.lowlevel.current_trio_token()
        bad = [0]
        failed: list[str] = []
        uncovered: list[frozenset[str]] = []

        def pull() -> None:
            try:
                call = p.stub.Snapshot(pb.SnapshotRequest(from_node=self.node_id,
                                                          listen=self.listen, since_s=since),
                                       timeout=SNAPSHOT_TIMEOUT,
                                       metadata=self.members.metadata, wait_for_ready=True)
                for batch in call:
                    if batch.HasField("coverage"):  # the stream's last message
                        try:
                            check_batch(batch)
                            uncovered.append(frozenset(batch.coverage.uncovered))
                        except BadRequest:
                            bad[0] += 1
                        continue
                    good = []
                    for e in batch.entries:
                        try:
                            check_entry(e)
                            good.append(first_hand(e, p.node_id) if p.node_id else e)
                        except BadRequest:
                            bad[0] += 1
                    trio.from_thread.run(send.send, good, trio_token=token)
            finally:
                trio.from_thread.run_sync(send.close, trio_token=token)

        async def run_pull() -> None:
            try:
                await trio.to_thread.run_sync(pull, limiter=self.transfers.grpc)
            except grpc.RpcError as e:
                failed.append(f"{e.code().name}: {e.details()}")
            except trio.BrokenResourceError:
                failed.append("abandoned")

        entries = applied = 0
        with applying_snapshot(self.remote.index.ns):
            async with trio.open_nursery() as n, recv:
                n.start_soon(run_pull)
                async for piece in recv:
                    entries += len(piece)
                    # In slices, so that FUSE requests are served between them.
                    for i in range(0, len(piece), MAX_BATCH):
                        applied += self.remote.apply(piece[i:i + MAX_BATCH])
                        await trio.sleep(0)
                    if republish:
                        self.outbox.put(piece)
        self.later.poke()
        if bad[0]:
            self.stats.error(f"snapshot from {p.addr}: {bad[0]} malformed entries ignored")
        if failed:
            self.stats.error(f"snapshot from {p.addr}: {failed[0]} ({entries} entries applied)")
            return Pulled(False)
        self.stats.snapshots_pulled += 1
        self.stats.delta_snapshots_pulled += since > 0
        log.info("caught up with %s (%s)%s: %d entries, %d applied%s", p.addr, p.node_id,
                 f" (changes of the last {since:.0f} s)" if since else "", entries, applied,
                 ", republished" if republish else "")
        return Pulled(True, uncovered[0] if uncovered else None)



class Join:
    """A host starting: every configured peer hears of it, and it pulls ONE live,
    caught-up host's snapshot (bounded by the commit timeout)."""

    def __init__(self, members: Membership, puller: SnapshotPuller,
                 commit_timeout: float) -> None:
        self.members = members
        self.puller = puller
        self.commit_timeout = commit_timeout

    async def run(self) -> None:
        members = self.members
        synced = False
        next_hello = 0.0
        with trio.move_on_after(self.commit_timeout):
            while True:
                now = trio.current_time()
                if now >= next_hello:
                    next_hello = now + 0.5
                    for p in members.peers.values():
                        if p.addr not in members.answered and not p.known_dead:
                            members.hello(p.addr)
                answered = [p for p in members.live() if p.addr in members.answered]
                if answered and not synced:
                    # One host's view of the others (which are dead, which are alive).
                    members.join(random.choice(answered))
                    synced = True
                if all(p.addr in members.answered or p.known_dead
                       for p in members.peers.values()):
                    break
                await members.changed(0.1)
        missing = [p for p in members.peers.values()
                   if p.addr not in members.answered and not p.known_dead]
        for p in missing:
            log.warning("peer %s has not answered within %.0f s of starting: going live "
                        "without it; commits wait for it until it answers or is found dead",
                        p.addr, self.commit_timeout)
        answered = [p for p in members.live() if p.addr in members.answered]
        ready = [p for p in answered if p.ready]
        # Every live host has every committed change (the commit rule): one caught-up
        # host's snapshot is enough (another's if that pull fails). None caught up yet
        # (the whole job is starting): each one's own.
        if ready:
            random.shuffle(ready)
            for p in ready:  # the next one if a pull fails
                if await self.puller.catch_up(p):
                    break
            return
        async with trio.open_nursery() as n:
            for p in answered:
                n.start_soon(self.puller.catch_up, p)

