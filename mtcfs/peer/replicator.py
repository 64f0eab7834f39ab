"""Replication: each sealed file this host wrote goes to K peers (placement),
in the background, yielding to the trainer's writes, over the data channel or
over gRPC from worker processes (mtcfs.peer.mover). A replica counts once the
receiver verified and stored it; it is recorded through `Copies`, which
announces it (the peer tier hears that as it hears any copy change)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from mtcfs.core.copies import Copies
from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.core.retired import RetiredSteps
from mtcfs.core.versions import local_only
from mtcfs.fs.writeclock import WriteClock
from mtcfs.peer import mover, placement, security
from mtcfs.peer.datachannel import DataChannel
from mtcfs.peer.dissemination import Broadcaster
from mtcfs.peer.index import ReplicatedIndex, directories_above
from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.outbox import COPY_WAIT_BYTES
from mtcfs.peer.stats import Stats
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

DRAIN_WAIT = 2.0  # a push waits this long at most for its file's entry to be everywhere
STALL_TIMEOUT = 5.0  # a transfer with no progress for this long is abandoned
REPLICATION_WORKERS = 2  # files pushed at once (a large one keeps a link busy) ...
# ... and small files (one block) besides: their changes wait for their copies
# (mtcfs.peer.outbox), and a push of one is a round trip, not bandwidth.
SMALL_PUSHES = 2
RETRY_SHORT = 10.0  # how often files short of K copies are tried again


@dataclass(frozen=True)
class PeerSettings:
    """The peer tier's options (the mount's --listen, --replicas, ...)."""

    node_id: str
    listen: str
    replicas: int
    secret: bytes | None = None
    tls: tuple[bytes, bytes, bytes | None] | None = None
    failure_domain: str = ""
    commit_timeout: float = 10.0
    peer_group: int = 0  # hosts per dissemination group (mtcfs.peer.grouped; 0: auto)
    peer_group_turn: float = 0.0  # seconds each host of a group leads (0: the first, always)


@dataclass(frozen=True)
class Transfers:
    """How many transfers run at once: gRPC calls in threads and worker processes
    (pulls, fetches, pushes), data-channel transfers in threads."""

    grpc: trio.CapacityLimiter
    bulk: trio.CapacityLimiter
    grpc_bytes: bool  # file bytes may move over gRPC (not with --peer-encryption and no TLS)

    @classmethod
    def of(cls, settings: PeerSettings, channel: DataChannel) -> Transfers:
        return cls(trio.CapacityLimiter(32), trio.CapacityLimiter(64),
                   not channel.encrypts or settings.tls is not None)


class ReplicationQueue:
    """Files waiting for copies, and those being pushed now."""

    def __init__(self) -> None:
        self.waiting: dict[int, Inode] = {}
        self.running: dict[int, Inode] = {}
        self._wake = trio.Event()

    def add(self, node: Inode, wake: bool = True) -> None:
        if local_only(node):
            return  # no checksums to verify a copy by: kept on this host only
        self.waiting[node.ino] = node
        if wake:
            self._wake.set()

    def drop(self, node: Inode) -> None:
        """Removed, or replaced by a version written elsewhere: no copies wanted."""
        self.waiting.pop(node.ino, None)

    def wake(self) -> None:
        self._wake.set()

    async def wait(self, timeout: float) -> bool:
        """Until a file is added (True), or `timeout` passed (False)."""
        woken = False
        with trio.move_on_after(timeout):
            await self._wake.wait()
            woken = True
        self._wake = trio.Event()
        return woken

    def empty(self) -> bool:
        return not self.waiting and not self.running

    def files(self) -> list[Inode]:
        return list({**self.waiting, **self.running}.values())


class PushWorkers:
    """The worker processes that stream replicas over gRPC (mtcfs.peer.mover),
    started on the first push that needs them."""

    def __init__(self, shared_last_write: Any) -> None:
        self._shared_last_write = shared_last_write
        self._pools: list[ProcessPoolExecutor] = []  # none yet, or the one running

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if not self._pools:
            self._pools.append(ProcessPoolExecutor(
                max_workers=REPLICATION_WORKERS,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=mover.init_worker, initargs=(self._shared_last_write,)))
        return self._pools[0].submit(fn, *args)

    def broken(self) -> None:
        self._pools.clear()

    def shutdown(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)


class Replicator:
    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, members: Membership,
                 clock: WriteClock, retired: RetiredSteps, index: ReplicatedIndex,
                 broadcaster: Broadcaster, channel: DataChannel, queue: ReplicationQueue,
                 stats: Stats, settings: PeerSettings, transfers: Transfers) -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.members = members
        self.clock = clock  # when the trainer last wrote: pushes yield to it
        self.retired = retired  # steps retention dropped everywhere need no more replicas
        self.index = index
        self.broadcaster = broadcaster
        self.channel = channel
        self.queue = queue
        self.stats = stats
        self.node_id = settings.node_id
        self.replicas = settings.replicas
        self.failure_domain = settings.failure_domain
        self.tls = settings.tls
        self.transfers = transfers
        self._urgent: dict[int, int] = {}  # ino -> fsyncs waiting for its copies
        # Files a replicate() left short of K copies (no peer took one): what the idle
        # workers try again every RETRY_SHORT. (Not every file: on a large job's index
        # that scan cost an idle host about 1 % of a core at 80,000 files.)
        self.short: dict[int, Inode] = {}
        # The trainer's write clock, shared with the push workers (spawned processes).
        self._shared_last_write = multiprocessing.get_context("spawn").RawValue("d", 0.0)
        self._workers = PushWorkers(self._shared_last_write)
        self._grpc_pushes = 0  # pushes in the workers now: they read the clock above
        self._large = trio.CapacityLimiter(REPLICATION_WORKERS)  # files over one block
        self._push_started = trio.Event()

    def start(self, nursery: trio.Nursery) -> None:
        self.requeue()
        nursery.start_soon(self._share_write_clock)
        for _ in range(REPLICATION_WORKERS + SMALL_PUSHES):
            nursery.start_soon(self._worker)

    def stop(self) -> None:
        self._workers.shutdown()

    # -- what needs copies --------------------------------------------------------------

    def sealed(self, node: Inode) -> None:
        if self.replicas > 0:
            self.queue.add(node)
            if self.members.live() and self.needs_copies(node):
                self.broadcaster.outbox.copying(node.guid, node.size)

    def fsync_waiting(self, node: Inode, waiting: bool) -> None:
        n = self._urgent.get(node.ino, 0) + (1 if waiting else -1)
        if n > 0:
            self._urgent[node.ino] = n
        else:
            self._urgent.pop(node.ino, None)

    def urgent(self, node: Inode) -> bool:
        """An fsync waits for this file's copies: its push does not yield."""
        return node.ino in self._urgent

    def _yields(self, node: Inode) -> bool:
        """Its push pauses while the trainer writes: not when an fsync waits for it, nor
        for a small file, whose change waits for it (mtcfs.peer.outbox) and whose push
        costs less than the wait."""
        return not self.urgent(node) and node.size > COPY_WAIT_BYTES

    def busy(self, node: Inode) -> bool:
        return node.ino in self.queue.running

    def needs_copies(self, node: Inode) -> bool:
        # Only copies on live peers count: a dead holder's copy is made again elsewhere.
        return (self.replicas > 0 and node.linked and node.state == CLOSED and node.has_data
                and not node.dirty and node.author == self.node_id
                and not (node.persisted and self.retired.contains(node))
                and len([h for h in node.holders if h != self.node_id
                         and self.members.by_node(h) is not None]) < self.replicas)

    def requeue(self, wake: bool = True) -> None:
        """Every file short of copies into the queue (start-up, peers changed)."""
        self._requeue(self.ns.files(), wake)

    def retry_short(self, wake: bool = True) -> None:
        """The files left short of copies into the queue again (a timed retry)."""
        for ino, node in list(self.short.items()):
            if not self.needs_copies(node):
                del self.short[ino]
        self._requeue(list(self.short.values()), wake)

    def _requeue(self, nodes: list[Inode], wake: bool) -> None:
        for node in nodes:
            if self.needs_copies(node) and node.ino not in self.queue.running:
                self.queue.add(node, wake=False)
        if self.queue.waiting and wake:
            self.queue.wake()

    # -- the workers ----------------------------------------------------------------------

    async def _worker(self) -> None:
        queue = self.queue
        while True:
            while not queue.waiting:
                woken = await queue.wait(RETRY_SHORT)
                if not woken and not queue.waiting:
                    # Files a peer refused for now (full, busy, not caught up yet),
                    # retried every RETRY_SHORT: without waking the other worker,
                    # which would find the same files and spin.
                    self.retry_short(wake=False)
            ino, node = next(iter(queue.waiting.items()))
            del queue.waiting[ino]
            if not self.needs_copies(node) or ino in queue.running:
                self.broadcaster.outbox.copied(node.guid)
                continue
            queue.running[ino] = node
            try:
                async with (self._large if node.size > COPY_WAIT_BYTES
                            else contextlib.nullcontext()):
                    await self.replicate(node)
            except Exception:  # a bug here must not take the mount down: log, go on
                log.exception("replicating %s failed", self.ns.path_of(node)
                              if node.linked else node.guid)
            finally:
                self.broadcaster.outbox.copied(node.guid)
                queue.running.pop(ino, None)
                if self.needs_copies(node):
                    self.short[ino] = node
                else:
                    self.short.pop(ino, None)

    async def replicate(self, node: Inode) -> None:
        """Push `node` to peers until it has K copies on live peers, or no peer is
        left to try."""
        version = node.version
        tried: set[str] = set()
        while self.needs_copies(node):
            if node.version != version:  # sealed again meanwhile: replicate the new one
                version, tried = node.version, set()
            target = self.target(node, tried)
            if target is None:
                log.debug("%s: no peer available for another replica", self.ns.path_of(node))
                return  # requeued when a peer comes alive
            tried.add(target.node_id)
            if (node.size > COPY_WAIT_BYTES
                    or len(directories_above(self.ns, node)) > security.MAX_ANCESTRY):
                # Its change does not wait for this push (a large file), or it has
                # more directories than a push carries: the receiver learns of it
                # first, as every host does.
                await self._drained(target)
            if not self.needs_copies(node) or node.version != version:
                continue  # removed (its directory may be gone too) or rewritten meanwhile
            if await self.push(node, target) and node.version == version and node.linked:
                self.copies.replica_made(node, target.node_id)

    def target(self, node: Inode, tried: set[str]) -> Peer | None:
        """The next peer for a replica: placement's order, not a holder, not tried."""
        ranked = placement.rank(self.node_id, self.failure_domain, self.members.live())
        return next((p for p in ranked if p.node_id not in node.holders
                     and p.node_id not in tried), None)

    async def _drained(self, p: Peer) -> None:
        """Wait (bounded) until this host's changes have reached every host: a receiver
        that does not know a replica's directory yet (one the push could not carry)
        holds its entry aside until the directory arrives, and refuses the replica; and
        a writer killed part-way through a large push leaves the receiver knowing the
        file, with no copy of it."""
        if p.alive:
            await self.broadcaster.changes_out(DRAIN_WAIT)

    # -- one push -------------------------------------------------------------------------

    async def push(self, node: Inode, p: Peer) -> bool:
        """One replica of `node` to `p`: True if `p` holds a verified copy now."""
        entry = self.index.entry_of(node)
        # Its directories travel with it: the receiver places the file before this
        # host's batch naming them reaches it (which a small file's change waits in
        # for this push: mtcfs.peer.outbox).
        above = [self.index.entry_of(d) for d in
                 directories_above(self.ns, node)[-security.MAX_ANCESTRY:]]
        for d in above:
            d.ClearField("merged_ids")  # (thousands at a large job: the batch brings them)
        path = self.ns.path_of(node)
        t0 = time.monotonic()
        grpc_bytes = self.transfers.grpc_bytes
        p.busy += 1
        try:
            code, details, stored = "", "", False
            if self.channel.reaches(p) and entry.block_crcs:
                code, details, stored = await self._bulk_push(node, p, entry, above, path)
                if code == "OK" and stored:
                    self.stats.bulk_replicas_sent += 1
                elif (code == "UNAVAILABLE" and details.startswith("data channel")
                      and grpc_bytes):
                    # Its data port unreachable (a firewall?), its gRPC port is not.
                    log.warning("replica of %s to %s: %s; over gRPC instead", path, p.node_id,
                                details)
                    code = ""
            if not code and not grpc_bytes and entry.size:  # (no bytes: no secret)
                code, details = "FAILED_PRECONDITION", (
                    f"{p.node_id} has no data channel, and peer encryption keeps file "
                    f"bytes off plain gRPC" if not p.data_port else details)
            if not code:
                code, details, stored = await self._grpc_push(node, p, entry, above, path)
        finally:
            p.busy -= 1
        return self._pushed(node, p, entry, path, code, details, stored, t0)

    async def _bulk_push(self, node: Inode, p: Peer, entry: pb.Entry, above: list[pb.Entry],
                         path: str) -> tuple[str, str, bool]:
        """The replica over the data channel, from a worker thread (the kernel copies:
        sendfile; per 4 MiB block only a MAC in Python, which releases the GIL)."""
        try:
            fd = self.ram.open_read(node.ino)
        except FileNotFoundError:
            return "NOT_FOUND", "the file's data is gone here", False
        yields = self._yields(node)
        yielded = [0.0]
        pin = self.ram.mapped.pin(node.ino)  # sent from a mapping: no shrink meanwhile

        def yield_to_writes() -> None:
            if yields:
                yielded[0] += mover.pause_while_writing(self.clock.last_write,
                                                        mover.MAX_YIELD - yielded[0])

        try:
            return await trio.to_thread.run_sync(
                partial(self.channel.push, above=above), p, fd, entry, path, yield_to_writes,
                pin.mapped,
                limiter=self.transfers.bulk)
        finally:
            pin.release()
            os.close(fd)

    async def _grpc_push(self, node: Inode, p: Peer, entry: pb.Entry, above: list[pb.Entry],
                         path: str) -> tuple[str, str, bool]:
        """The replica over gRPC, from a worker process (mtcfs.peer.mover)."""
        size = node.size
        self._shared_last_write.value = self.clock.last_write()
        self._grpc_pushes += 1
        self._push_started.set()
        try:
            return await trio.to_thread.run_sync(
                partial(self._workers.submit(
                    mover.push, p.addr, self.tls, self.members.metadata,
                    pb.PushHeader(entry=entry, path=path, above=above).SerializeToString(),
                    self.ram.path(node.ino), size,
                    60 + size / (20 << 20), STALL_TIMEOUT, not self._yields(node)).result),
                limiter=self.transfers.grpc)
        except BrokenProcessPool:
            self._workers.broken()  # a worker died (killed?): a new pool next time
            return "UNAVAILABLE", "the replication worker died", False
        finally:
            self._grpc_pushes -= 1

    def _pushed(self, node: Inode, p: Peer, entry: pb.Entry, path: str, code: str,
                details: str, stored: bool, t0: float) -> bool:
        """What a push's outcome means: a replica made, or why not."""
        size = entry.size
        if code == "ALREADY_EXISTS":
            # It holds a verified copy of this version already (e.g. it read it
            # through): that copy counts.
            log.info("%s already holds %s", p.node_id, path)
            return True
        if code in ("FAILED_PRECONDITION", "NOT_FOUND") and (
                not node.linked or node.version != entry.version or node.dirty):
            log.info("replica of %s to %s dropped: the file changed meanwhile", path, p.node_id)
            return False
        if code != "OK":
            self.stats.replica_failures += 1
            self.stats.error(f"replica of {path} to {p.addr} ({p.node_id}): {code}: {details}")
            if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
                self.members.failed(p, f"push: {code}")
            return False
        if not stored:
            return False
        self.stats.replicas_sent += 1
        self.stats.replica_bytes_sent += size
        log.info("replicated %s to %s (%d bytes, %.2f s)", path, p.node_id, size,
                 time.monotonic() - t0)
        return True

    # -- the trainer's write clock ----------------------------------------------------------

    def yield_to_writes(self, budget: float) -> float:
        """In a receiving thread: pause while this host's trainer writes (bounded)."""
        return mover.pause_while_writing(self.clock.last_write, budget)

    async def _share_write_clock(self) -> None:
        """The write clock for the push workers, every mover.PAUSE while a push runs
        (none: nothing to wake for)."""
        while True:
            if self._grpc_pushes:
                self._shared_last_write.value = self.clock.last_write()
                await trio.sleep(mover.PAUSE)
                continue
            await self._push_started.wait()
            self._push_started = trio.Event()
