"""The peer tier: this host's part in the job's one filesystem.

- The replicated index (mtcfs.peer.index) is kept in step by sending local
  changes in batches down a tree of the live hosts (mtcfs.peer.dissemination:
  each host forwards to a few), acknowledged back up it.
- Each sealed file is pushed to K peers (mtcfs.peer.placement), in the
  background, with bounded concurrency; a replica counts once the receiver
  has verified it and stored it in its RAM tier.
- Files whose data is elsewhere are fetched from their live holders, block by
  block verified against the index's per-block crc32cs (mtcfs.fetch drives it).
- File bytes move over the bulk data channel (mtcfs.peer.bulk) to and from
  peers that offer one, striped over all holders for fetches
  (mtcfs.peer.striped); over gRPC to and from peers that do not.

Runs in the daemon's trio thread; blocking gRPC calls run in worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import trio

from mtcfs.checksums import BLOCK, BlockVerifier, IntegrityError, block_count
from mtcfs.events import Listener
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.namespace import CLOSED, SEALING, Inode, Namespace
from mtcfs.fs.writeclock import WriteClock
from mtcfs.lifecycle.copies import Copies
from mtcfs.lifecycle.retired import RetiredSteps
from mtcfs.peer import fanout, mover, placement, restore, wire
from mtcfs.peer.addresses import parse_address
from mtcfs.peer.bulk import BulkPool, BulkServer
from mtcfs.peer.catchup import CatchUps, Pulled
from mtcfs.peer.dissemination import Broadcaster, Reply
from mtcfs.peer.index import Hooks, ReplicatedIndex, gc_paused
from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.security import BadRequest, check_batch, check_entry
from mtcfs.peer.server import Refused, start_server
from mtcfs.peer.striped import Progress, Striped
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.durable import DurableTier
from mtcfs.tiers.durable.base import chunk_plan
from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

BROADCAST_TIMEOUT = 5.0
DRAIN_WAIT = 2.0  # a push waits this long at most for its file's entry to be everywhere
SNAPSHOT_TIMEOUT = 60.0
STALL_TIMEOUT = 5.0  # a transfer with no progress for this long is abandoned
MAX_BATCH = 500  # snapshot entries applied per slice (FUSE is served between slices)
REPLICATION_WORKERS = 2
RETRY_SHORT = 10.0  # how often files short of K copies are tried again


class PeerFetchError(OSError):
    pass


@dataclass
class Stats:
    replicas_sent: int = 0
    replica_bytes_sent: int = 0
    replicas_received: int = 0
    replica_bytes_received: int = 0
    replica_failures: int = 0
    fetched_files: int = 0
    fetched_bytes: int = 0
    fetch_failures: int = 0
    bulk_replicas_sent: int = 0  # of replicas_sent, over the data channel
    bulk_fetched_bytes: int = 0  # of fetched_bytes, over the data channel
    integrity_errors: int = 0
    restores: int = 0  # persisted files read through together with other sources
    restore_bucket_bytes: int = 0  # of those, read from the durable tier by this host
    restore_peer_bytes: int = 0  # of those, taken from other sources
    restore_sources_dropped: int = 0
    restore_refusals: int = 0  # chunks an owner said it would not have (views differed)
    restore_forced_chunks: int = 0  # of those, read from the bucket here after all
    restore_from_earlier: int = 0  # chunks of this host's share an earlier source had
    batches_received: int = 0
    snapshots_pulled: int = 0
    delta_snapshots_pulled: int = 0  # of those: only what changed while it was away
    snapshots_served: int = 0
    delta_snapshots_served: int = 0  # of those: only what changed here lately
    snapshot_entries_served: int = 0
    last_error: str = ""


class _Progress:
    """Shared between a transfer's worker thread and its watchdog."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.call: Any = None

    def tick(self) -> None:
        self.last = time.monotonic()


class _Applied(Hooks):
    """What applying other hosts' changes does around the namespace: the kernel's
    caches, this host's stale data, the parts that react to remote changes."""

    def __init__(self, tier: PeerTier) -> None:
        self.tier = tier

    def forget_data(self, node: Inode) -> None:
        self.tier.repl_queue.pop(node.ino, None)
        self.tier.ram.remove(node.ino)

    def invalidate(self, parent: Inode, name: bytes, node: Inode | None) -> None:
        self.tier.kernel.entry(parent.ino, name)

    def removed(self, node: Inode) -> None:
        self.tier.repl_queue.pop(node.ino, None)
        self.tier.events.remote_removed(node)

    def moved(self, node: Inode) -> None:
        self.tier.events.remote_moved(node)

    def attrs_changed(self, node: Inode) -> None:
        self.tier.kernel.attrs(node.ino)


class PeerTier(Listener):
    """This host's part in the job's one filesystem: it hears of this host's changes
    (as a Listener) and broadcasts them, replicates sealed files, serves and fetches
    copies, and applies other hosts' changes (mtcfs.peer.index)."""

    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                 kernel: KernelCache, members: Membership, clock: WriteClock,
                 retired: RetiredSteps, *, node_id: str, listen: str, replicas: int,
                 secret: bytes | None, tls: tuple[bytes, bytes, bytes | None] | None = None,
                 failure_domain: str = "", commit_timeout: float = 10.0,
                 bulk: BulkPool | None = None,
                 bulk_server: Callable[[PeerTier, trio.lowlevel.TrioToken], BulkServer] | None
                 = None
                 ) -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.events = events
        self.kernel = kernel
        self.members = members
        self.clock = clock  # when the trainer last wrote: replication yields to it
        self.retired = retired  # steps retention dropped everywhere need no more replicas
        self.node_id = node_id
        self.listen = listen
        self.replicas = replicas
        self.secret = secret
        self.tls = tls
        self.failure_domain = failure_domain
        self.commit_timeout = commit_timeout
        self.index = ReplicatedIndex(ns, node_id, _Applied(self), copies)
        self.broadcaster = Broadcaster(self.members, node_id, lambda: self.index.clock,
                                       self._send_tree, self._deliver, kernel.settle,
                                       commit_timeout)
        self.index.outbox = self.broadcaster.publish
        self.stats = Stats()
        self.server: grpc.Server | None = None
        self.port = 0
        # The bulk data channel: connections to peers' (bulk) and our own server, made
        # at start (it calls into the trio thread). None: file bytes over gRPC only.
        self.bulk = bulk
        self._make_bulk_server = bulk_server
        self.bulk_server: BulkServer | None = None
        self.data_port = 0
        self._bulk_limiter = trio.CapacityLimiter(64)
        self.restores: dict[int, restore.Restore] = {}  # ino -> this host's restore of it
        self.repl_queue: dict[int, Inode] = {}
        self.replicating: dict[int, Inode] = {}
        self._urgent: dict[int, int] = {}  # ino -> fsyncs waiting for its copies
        self._wake_repl = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._started = False
        # Peers found dead since we started, caught up with once they are back.
        self.catchups = CatchUps(self.members.me, self.members, self._pull,
                                 self._settle_republished, self._announce_caught_up,
                                 self.events.peers_changed)
        self._limiter = trio.CapacityLimiter(32)
        self._mover: ProcessPoolExecutor | None = None
        # The trainer's write clock, shared with the push workers (spawned processes).
        self._shared_last_write = multiprocessing.get_context("spawn").RawValue("d", 0.0)

    # -- start-up --------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Listen, make every configured peer hear of this host (each answers: from then
        on it counts this host for its commits), learn the others' view from one of
        them, and pull ONE live, caught-up host's snapshot (bounded by the commit
        timeout): before the mount is announced live, so a new host sees the whole tree
        at once, and what is committed after the snapshot reaches it by broadcast."""
        self._nursery = nursery
        self.server, self.port = start_server(self, self.listen,
                                              trio.lowlevel.current_trio_token(),
                                              self.secret, self.tls)
        if self._make_bulk_server is not None:
            self.bulk_server = self._make_bulk_server(self, trio.lowlevel.current_trio_token())
            self.data_port = self.bulk_server.start()
        me = self.members.local
        me.data_port = self.data_port
        me.ram_free = max(0, self.ram.capacity - self.ram.used)
        me.ready = False
        self.members.open()
        nursery.start_soon(self.members.run)
        # Batches reach this host while it joins: their acks must not wait for it.
        nursery.start_soon(self.broadcaster.run)
        await self._join()
        me.ready = True
        self._started = True
        self.catchups.start(nursery)
        self._requeue_unreplicated()
        nursery.start_soon(self._share_write_clock)
        for _ in range(REPLICATION_WORKERS):
            nursery.start_soon(self._replication_worker)

    async def _join(self) -> None:
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
                if await self.catch_up(p):
                    break
            return
        async with trio.open_nursery() as n:
            for p in answered:
                n.start_soon(self.catch_up, p)

    def stop(self) -> None:
        if self._mover is not None:
            self._mover.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop(grace=0.5)
        if self.bulk_server is not None:
            self.bulk_server.stop()
        if self.bulk is not None:
            self.bulk.close()
        self.members.close()

    # -- membership (Listener) --------------------------------------------------------

    def peer_alive(self, peer: Peer) -> None:
        if peer.ready:
            self.catchups.back(peer, self.members.incarnation_of(peer.addr))
        # (Not ready: starting, it takes our changes and has none of its own; or back
        # by gossip before it spoke to us: caught up with once it says it is ready.)
        self._requeue_unreplicated()

    def peer_restarted(self, peer: Peer) -> None:
        self.broadcaster.restarted(peer.addr)

    def peer_ready(self, peer: Peer) -> None:
        if peer.addr in self.catchups.owed:  # back by gossip before it spoke to us
            self.catchups.back(peer, self.members.incarnation_of(peer.addr))

    def peer_dead(self, peer: Peer) -> None:
        if self._started:
            self.catchups.dead(peer, self.members.incarnation_of(peer.addr))
        self._requeue_unreplicated()

    def peers_changed(self) -> None:
        self.broadcaster.kick()

    def hosts_accounted(self) -> bool:
        """Every host of the job is alive and caught up with, or gone for good: what a
        host cut off for a moment wrote meanwhile is known here (commit markers wait)."""
        return self.catchups.accounted() and self.members.all_accounted()

    async def catch_up(self, p: Peer) -> bool:
        """Pull `p`'s whole snapshot (a host starting)."""
        return (await self._pull(p, 0.0)).ok

    async def _pull(self, p: Peer, since: float = 0.0, republish: bool = False) -> Pulled:
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
                            good.append(e)
                        except BadRequest:
                            bad[0] += 1
                    trio.from_thread.run(send.send, good, trio_token=token)
            finally:
                trio.from_thread.run_sync(send.close, trio_token=token)

        async def run_pull() -> None:
            try:
                await trio.to_thread.run_sync(pull, limiter=self._limiter)
            except grpc.RpcError as e:
                failed.append(f"{e.code().name}: {e.details()}")
            except trio.BrokenResourceError:
                failed.append("abandoned")

        entries = applied = 0
        with gc_paused():
            async with trio.open_nursery() as n, recv:
                n.start_soon(run_pull)
                async for piece in recv:
                    entries += len(piece)
                    # In slices, so that FUSE requests are served between them.
                    for i in range(0, len(piece), MAX_BATCH):
                        applied += self._apply(piece[i:i + MAX_BATCH])
                        await trio.sleep(0)
                    if republish:
                        self.broadcaster.publish(piece)
        if bad[0]:
            self._error(f"snapshot from {p.addr}: {bad[0]} malformed entries ignored")
        if failed:
            self._error(f"snapshot from {p.addr}: {failed[0]} ({entries} entries applied)")
            return Pulled(False)
        self.stats.snapshots_pulled += 1
        self.stats.delta_snapshots_pulled += since > 0
        log.info("caught up with %s (%s)%s: %d entries, %d applied%s", p.addr, p.node_id,
                 f" (changes of the last {since:.0f} s)" if since else "", entries, applied,
                 ", republished" if republish else "")
        return Pulled(True, uncovered[0] if uncovered else None)

    async def _settle_republished(self, what: str) -> bool:
        return not await self.broadcaster.wait_applied(what)

    def _announce_caught_up(self, hosts: list[str], since_unix: float) -> None:
        self.broadcaster.announce(pb.CaughtUp(hosts=hosts, since_unix=since_unix))

    # -- this host's changes (Listener) ----------------------------------------------

    def sealed(self, node: Inode) -> None:
        self.index.changed(node)
        if self.replicas > 0:
            self.repl_queue[node.ino] = node
            self._wake_repl.set()

    def resealed(self, node: Inode) -> None:
        self.index.changed(node)

    def changed(self, nodes: list[Inode]) -> None:
        self.index.changed(*nodes)

    def linked(self, node: Inode) -> None:
        self.index.changed(node)

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        self.index.changed(node)

    def removed(self, node: Inode, path: str) -> None:
        self.repl_queue.pop(node.ino, None)
        self.index.removed(node)

    def persisted(self, node: Inode) -> None:
        self.index.holders_changed(node)

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        if node.generation:  # a bucket object: maybe restored here (its sources change)
            self.index.sources_changed(node, dropped=dropped)
        else:
            self.index.holders_changed(node, dropped=dropped)

    def fsync_waiting(self, node: Inode, waiting: bool) -> None:
        n = self._urgent.get(node.ino, 0) + (1 if waiting else -1)
        if n > 0:
            self._urgent[node.ino] = n
        else:
            self._urgent.pop(node.ino, None)

    def urgent(self, node: Inode) -> bool:
        """An fsync waits for this file's copies: its push does not yield."""
        return node.ino in self._urgent

    def busy(self, node: Inode) -> bool:
        return node.ino in self.replicating

    def settling(self) -> bool:
        """Replication in flight or queued (it can make data evictable)."""
        return bool(self.replicas and self.members.live() and not self.quiet())

    # -- broadcast -------------------------------------------------------------------

    def _send_tree(self, addr: str, msg: fanout.Message, attempt: int = 0) -> None:
        """One message down or up a tree, one way: not waited for (a lost one is sent
        again by the tree), so the trio thread never blocks on a peer."""
        call = self.members.stub_for(addr).Forward.future(wire.tree_to_pb(self.members.me, msg),
                                   timeout=BROADCAST_TIMEOUT, metadata=self.members.metadata)
        token = trio.lowlevel.current_trio_token()

        def sent(call: grpc.Future) -> None:  # in a gRPC thread
            b = self.broadcaster
            if call.exception() is not None:
                then: Callable[[], None] = partial(b.send_failed, addr, msg, attempt)
            elif call.result().acked:
                then = partial(b.acked_in_reply, addr, msg)
            else:
                then = partial(b.delivered, addr, msg)

            def in_trio() -> None:
                # Not a task: an exception here would end the whole run (shutting down,
                # the broadcaster's nursery may be closed already).
                try:
                    then()
                except Exception as e:
                    log.debug("tree message to %s: %s", addr, e)

            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(in_trio)

        call.add_done_callback(sent)

    def on_tree(self, request: pb.TreeMessage) -> Reply | None:
        """A batch down a tree, or an ack up it (in the trio thread, from the server);
        for a batch, what its handler may wait on to answer with the ack."""
        src, msg = wire.tree_from_pb(request)
        return self.broadcaster.on_message(src, msg)

    def _deliver(self, batch: pb.ChangeBatch) -> None:
        self.stats.batches_received += 1
        self._apply(list(batch.entries))
        if batch.HasField("caught_up"):
            self.catchups.marker(batch.from_node, batch.caught_up.hosts,
                                 batch.caught_up.since_unix)

    def on_batch(self, batch: pb.ChangeBatch) -> int:
        """A batch sent to this host alone (the Broadcast RPC: tools, older daemons);
        applied before the server answers."""
        self.stats.batches_received += 1
        return self._apply(list(batch.entries))

    def _apply(self, entries: list[pb.Entry]) -> int:
        n = self.index.apply(entries)
        if self.index.touched:
            self.events.remote_changed(self.index.touched)
        for node in self.index.disowned:
            # Listed as a holder of a copy this host does not have (a replacement with
            # the same node id, or one that evicted it): readers must not ask us.
            self.index.holders_changed(node, dropped=self.node_id)
        return n

    # -- the service's handler (mtcfs.peer.server.PeerHandler) ------------------------

    def lamport(self) -> int:
        return self.index.clock

    def needs_poke(self, listen: str) -> bool:
        return self.members.needs_poke(listen)

    def poke(self, listen: str) -> None:
        self.members.poke(listen)

    def kernel_settle(self, timeout: float) -> bool:
        return self.kernel.settle(timeout)

    def snapshot_for(self, from_node: str, listen: str, piece: int, since: float = 0.0
                     ) -> Iterator[list[pb.Entry]]:
        """A peer pulls our snapshot (since > 0: what changed here in the last `since`
        seconds, or all of it if the index cannot tell): it counts for commits from
        now on, before the first piece is made (both in the trio thread); what changes
        while the pieces are made reaches it by broadcast as well."""
        if listen:
            self.members.mark_alive(listen, from_node)
        pieces = self.index.delta_pieces(since, piece) if since > 0 else None
        self.stats.snapshots_served += 1
        self.stats.delta_snapshots_served += pieces is not None
        return self._counted(pieces if pieces is not None
                             else self.index.snapshot_pieces(piece))

    def uncovered(self) -> list[str]:
        """The hosts whose changes a snapshot served now may lack (its coverage)."""
        return self.catchups.uncovered()

    def _counted(self, pieces: Iterator[list[pb.Entry]]) -> Iterator[list[pb.Entry]]:
        for piece in pieces:
            self.stats.snapshot_entries_served += len(piece)
            yield piece

    def abort_receive(self, key: int, tmp: str) -> None:
        self.ram.abort_incoming(key, tmp)

    async def wait_applied(self, what: str, node: Inode | None = None) -> list[str]:
        """The commit rule: return once every live peer has applied everything this
        host published so far (and `node`'s directories, which another host may have
        made), or after --commit-timeout."""
        if node is not None:
            self.index.publish_ancestors(node)
        return await self.broadcaster.wait_applied(what)

    def quiet(self) -> bool:
        """Nothing waiting to be broadcast or replicated."""
        return self.broadcaster.quiet() and not self.repl_queue and not self.replicating

    # -- replication (sender) --------------------------------------------------------

    def _needs_copies(self, node: Inode) -> bool:
        # Only copies on live peers count: a dead holder's copy is made again elsewhere.
        return (self.replicas > 0 and node.linked and node.state == CLOSED and node.has_data
                and not node.dirty and node.author == self.node_id
                and not (node.persisted and self.retired.contains(node))
                and len([h for h in node.holders if h != self.node_id
                         and self.members.by_node(h) is not None]) < self.replicas)

    def _requeue_unreplicated(self, wake: bool = True) -> None:
        for node in self.ns.files():
            if self._needs_copies(node) and node.ino not in self.replicating:
                self.repl_queue[node.ino] = node
        if self.repl_queue and wake:
            self._wake_repl.set()

    async def _replication_worker(self) -> None:
        while True:
            while not self.repl_queue:
                woken = False
                with trio.move_on_after(RETRY_SHORT):
                    await self._wake_repl.wait()
                    woken = True
                self._wake_repl = trio.Event()
                if not woken and not self.repl_queue:
                    # Files a peer refused for now (full, busy, not caught up yet),
                    # retried every RETRY_SHORT: without waking the other worker,
                    # which would find the same files and spin.
                    self._requeue_unreplicated(wake=False)
            ino, node = next(iter(self.repl_queue.items()))
            del self.repl_queue[ino]
            if not self._needs_copies(node) or ino in self.replicating:
                continue
            self.replicating[ino] = node
            try:
                await self._replicate(node)
            except Exception:  # a bug here must not take the mount down: log, go on
                log.exception("replicating %s failed", self.ns.path_of(node)
                              if node.linked else node.guid)
            finally:
                self.replicating.pop(ino, None)

    async def _replicate(self, node: Inode) -> None:
        version = node.version
        tried: set[str] = set()
        while self._needs_copies(node):
            if node.version != version:  # sealed again meanwhile: replicate the new one
                version, tried = node.version, set()
            ranked = placement.rank(self.node_id, self.failure_domain, self.members.live())
            target = next((p for p in ranked if p.node_id not in node.holders
                           and p.node_id not in tried), None)
            if target is None:
                log.debug("%s: no peer available for another replica", self.ns.path_of(node))
                return  # requeued when a peer comes alive
            tried.add(target.node_id)
            await self._drained(target)
            if not self._needs_copies(node) or node.version != version:
                continue  # removed (its directory may be gone too) or rewritten meanwhile
            if await self._push(node, target) and node.version == version and node.linked:
                self.copies.replica_made(node, target.node_id)

    async def _drained(self, p: Peer) -> None:
        """Wait (bounded) until this host's changes have reached every host: a receiver
        that does not know a replica's directory yet holds its entry aside until the
        directory arrives."""
        deadline = time.monotonic() + DRAIN_WAIT
        while not self.broadcaster.quiet() and p.alive and time.monotonic() < deadline:
            await trio.sleep(0.005)

    async def _push(self, node: Inode, p: Peer) -> bool:
        entry = self.index.entry_of(node)
        path = self.ns.path_of(node)
        t0 = time.monotonic()
        p.busy += 1
        try:
            code, details, stored = "", "", False
            if self.bulk is not None and p.data_port and entry.block_crcs:
                code, details, stored = await self._bulk_push(node, p, entry, path)
                if code == "OK" and stored:
                    self.stats.bulk_replicas_sent += 1
                elif code == "UNAVAILABLE" and details.startswith("data channel"):
                    # Its data port unreachable (a firewall?), its gRPC port is not.
                    log.warning("replica of %s to %s: %s; over gRPC instead", path, p.node_id,
                                details)
                    code = ""
            if not code:
                code, details, stored = await self._grpc_push(node, p, entry, path)
        finally:
            p.busy -= 1
        return self._pushed(node, p, entry, path, code, details, stored, t0)

    async def _bulk_push(self, node: Inode, p: Peer, entry: pb.Entry,
                         path: str) -> tuple[str, str, bool]:
        """The replica over the data channel, from a worker thread (the kernel copies:
        sendfile; per 4 MiB block only a MAC in Python, which releases the GIL)."""
        assert self.bulk is not None
        try:
            fd = self.ram.open_read(node.ino)
        except FileNotFoundError:
            return "NOT_FOUND", "the file's data is gone here", False
        urgent = self.urgent(node)
        yielded = [0.0]

        def yield_to_writes() -> None:
            if not urgent:  # an fsync waits for this copy: its writer is blocked
                yielded[0] += mover.pause_while_writing(self.clock.last_write,
                                                        mover.MAX_YIELD - yielded[0])

        try:
            return await trio.to_thread.run_sync(
                self.bulk.push, self._data_addr(p), fd, entry, path, yield_to_writes,
                limiter=self._bulk_limiter)
        finally:
            os.close(fd)

    def _data_addr(self, p: Peer) -> tuple[str, int]:
        """A peer's data channel: the host of its --listen address, the port it said."""
        return parse_address(p.addr, "peer address")[0], p.data_port

    async def _grpc_push(self, node: Inode, p: Peer, entry: pb.Entry,
                         path: str) -> tuple[str, str, bool]:
        """The replica over gRPC, from a worker process (mtcfs.peer.mover)."""
        size = node.size
        try:
            return await trio.to_thread.run_sync(
                partial(self._pushes().submit(
                    mover.push, p.addr, self.tls, self.members.metadata,
                    entry.SerializeToString(), path, self.ram.path(node.ino), size,
                    60 + size / (20 << 20), STALL_TIMEOUT, self.urgent(node)).result),
                limiter=self._limiter)
        except BrokenProcessPool:
            self._mover = None  # a worker died (killed?): a new pool next time
            return "UNAVAILABLE", "the replication worker died", False

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
            self._error(f"replica of {path} to {p.addr} ({p.node_id}): {code}: {details}")
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

    def _pushes(self) -> ProcessPoolExecutor:
        """The worker processes that stream replicas (see mtcfs.peer.mover)."""
        if self._mover is None:
            self._mover = ProcessPoolExecutor(
                max_workers=REPLICATION_WORKERS,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=mover.init_worker, initargs=(self._shared_last_write,))
        return self._mover

    def yield_to_writes(self, budget: float) -> float:
        """In a receiving thread: pause while this host's trainer writes (bounded)."""
        return mover.pause_while_writing(self.clock.last_write, budget)

    async def _share_write_clock(self) -> None:
        while True:
            self._shared_last_write.value = self.clock.last_write()
            self.members.local.ram_free = max(0, self.ram.capacity - self.ram.used)
            await trio.sleep(mover.PAUSE)

    async def _watched(self, fn: Callable[[], Any], prog: _Progress) -> Any:
        """Run a blocking transfer in a thread; cancel it when it stops making progress
        (a partitioned peer must not hang a reader or a replication)."""
        result: list[Any] = []
        failure: list[BaseException] = []

        async def run(cancel_scope: trio.CancelScope) -> None:
            try:
                result.append(await trio.to_thread.run_sync(fn, limiter=self._limiter))
            except Exception as e:  # re-raised below, not as an exception group
                failure.append(e)
            cancel_scope.cancel()

        async with trio.open_nursery() as n:
            n.start_soon(run, n.cancel_scope)
            while True:
                await trio.sleep(0.5)
                if time.monotonic() - prog.last > STALL_TIMEOUT and prog.call is not None:
                    prog.call.cancel()
                    prog.last = time.monotonic()
        if failure:
            raise failure[0]
        return result[0]

    # -- replication (receiver) ------------------------------------------------------

    def begin_receive(self, e: pb.Entry) -> tuple[int, str]:
        node = self.ns.by_global_id(self.index.resolve(e.id))
        if node is not None and node.linked and node.version == e.version and node.has_data:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, "this node already holds it")
        if node is not None and node.linked and node.dirty:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "being rewritten here")
        if self.ram.free < e.size:
            self.events.room_needed(e.size, True)  # persisted data and caches only
        return self.ram.begin_incoming(e.size)

    def finish_receive(self, e: pb.Entry, key: int, tmp: str) -> bool:
        self.index.apply([e])
        node = self.ns.by_global_id(self.index.resolve(e.id))
        if node is None and self.index.is_pending(e.id):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "its directory has not reached this node yet; try again later")
        if (node is None or not node.linked or node.version != e.version
                or node.crc32c != e.crc32c or node.dirty):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "the file changed here meanwhile")
        if not node.has_data:
            self.ram.install_incoming(key, tmp, node.ino)
        self.copies.received(node)
        self.stats.replicas_received += 1
        self.stats.replica_bytes_received += e.size
        return True

    # -- serving data ----------------------------------------------------------------

    def open_for_fetch(self, guid: str, version: int) -> tuple[int, int]:
        node = self.ns.by_global_id(self.index.resolve(guid))
        if node is None or not node.linked:
            raise Refused(grpc.StatusCode.NOT_FOUND, "no such file here")
        # A file fsynced here and written again since is served at its fsynced version
        # (until it is sealed again): the reader verifies every block, so bytes that
        # changed meanwhile are refused there, never served as that version.
        rewritten = ((node.dirty or node.state == SEALING) and node.version > 0
                     and node.author == self.node_id)
        if not node.has_data or not (node.state == CLOSED and not node.dirty or rewritten):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "no complete copy here")
        if version and node.version != version:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"version {node.version} here, {version} asked for")
        size = node.sealed_size if rewritten else node.size
        return self.ram.open_read(node.ino), size

    def held(self) -> list[pb.HeldFile]:
        return [pb.HeldFile(id=n.guid, path=self.ns.path_of(n), version=n.version, size=n.size,
                            crc32c=n.crc32c or 0)
                for n in self.ns.files()
                if n.linked and n.has_data and n.state == CLOSED and not n.dirty]

    def health_reply(self) -> pb.HealthReply:
        return pb.HealthReply(node_id=self.node_id, lamport=self.index.clock,
                              failure_domain=self.failure_domain,
                              ram_capacity=self.ram.capacity,
                              ram_free=max(0, self.ram.capacity - self.ram.used),
                              entries=len(self.ns.inodes), data_port=self.data_port)

    # -- restoring from the durable tier together (mtcfs.peer.restore) ---------------

    def restore_sources(self, node: Inode) -> list[str]:
        """This host and the live peers that announced they restore (or have) this
        version and offer a data channel."""
        return sorted({self.node_id} | {
            s for s in node.sources if s != self.node_id
            for p in [self.members.by_node(s)] if p is not None and p.data_port})

    async def restore(self, node: Inode, fd: int, tier: DurableTier, key: str,
                      generation: int, parallel: int,
                      on_verified: Callable[[int, int], None]) -> dict[str, int] | None:
        """Read a persisted file through with every other host restoring it: this host's
        share of its chunks from the bucket, the rest from the sources that have them
        (mtcfs.peer.restore). Returns the bytes read from each place (the bucket as
        tier.url), or None when the object cannot be restored so (no data channel, or
        no chunk crc32cs to verify peers' chunks with): the caller reads it alone."""
        if self.bulk is None or not node.size or not self.data_port:
            return None
        bulk = self.bulk
        info = await trio.to_thread.run_sync(tier.stat, key)
        if info is None or info.generation != generation or info.size != node.size:
            return None
        plan = chunk_plan(f"{tier.url}: {key}", info)
        if plan is None:
            return None
        chunk, crcs = plan
        guid, version, size, path = node.guid, node.version, node.size, key
        os.ftruncate(fd, size)
        r = restore.Restore(self.node_id, guid, version, size, chunk, crcs,
                            os.fstat(fd).st_ino, lambda: self.restore_sources(node))
        self.restores[node.ino] = r
        self.copies.restoring(node)
        if r.chunks >= restore.SETTLE_CHUNKS:
            # Hosts reading it at the same moment hear of each other within milliseconds:
            # a short pause lets them split the file instead of each reading from the
            # bucket what it owns in its own partial view of the sources. (Not for a
            # small file: many read one after the other would add up.)
            await trio.sleep(restore.SETTLE)
        token = trio.lowlevel.current_trio_token()

        def fetch_peer(src: str, c: int, wait: bool) -> bool:
            p = trio.from_thread.run_sync(self.members.by_node, src, trio_token=token)
            if p is None or not p.data_port:
                raise PeerFetchError(5, f"{src} is not live")
            off, n = r.span(c)
            return bulk.fetch_chunk(self._data_addr(p), fd, guid, version, path, off, n,
                                    crcs[c], wait, r.stopped.is_set)

        def fetch_bucket(c: int) -> None:
            restore.read_chunk(r, fd, c, lambda off, n: tier.read_range(
                key, off, n, generation=generation), f"{tier.url}: {key}")

        ok = False
        try:
            await restore.run(r, fetch_peer, fetch_bucket, on_verified, parallel,
                              2 * parallel, bulk.connections)
            ok = True
        except BaseException as e:
            r.error = str(e) or type(e).__name__
            r.wake()
            raise
        finally:
            self.stats.restores += ok
            self.stats.restore_bucket_bytes += r.bucket_bytes
            self.stats.restore_peer_bytes += sum(r.peer_bytes.values())
            self.stats.restore_sources_dropped += len(r.failed)
            self.stats.restore_refusals += sum(r.refusals.values())
            self.stats.restore_forced_chunks += len(r.forced)
            self.stats.restore_from_earlier += r.from_before
            if r.failed:
                self.stats.last_error = f"restore of {path}: sources dropped: {r.failed}"
            if not ok:
                self.restores.pop(node.ino, None)
                if node.version == version:
                    self.copies.not_restoring(node)
        log.info("restored %s: %d bytes from %s, %s from peers%s", path, r.bucket_bytes,
                 tier.url, r.peer_bytes or 0, f" (dropped {r.failed})" if r.failed else "")
        return {**({tier.url: r.bucket_bytes} if r.bucket_bytes else {}), **r.peer_bytes}

    async def serve_chunk(self, guid: str, version: int, offset: int, length: int,
                          wait: bool, timeout: float) -> tuple[str, int, int]:
        """A peer restoring the same file asks for a chunk (mtcfs.bulk's `chunk`):
        ("ready", a read fd, size) once it is verified here; ("wait", -1, size) while
        it is still coming (asked again); ("no", -1, size) if it will not come here."""
        node = self.ns.by_global_id(self.index.resolve(guid))
        if node is None or not node.linked or (version and node.version != version):
            raise Refused(grpc.StatusCode.NOT_FOUND, "not this version here")
        r = self.restores.get(node.ino)
        if r is not None and (r.version != node.version or node.has_data):
            self.restores.pop(node.ino, None)  # done (or replaced): served as a whole copy
            r = None
        if r is None:
            fd, size = self.open_for_fetch(guid, version)
            if offset + length > size:
                os.close(fd)
                raise Refused(grpc.StatusCode.OUT_OF_RANGE, "beyond the end")
            return "ready", fd, size
        if offset % r.chunk or offset + length != sum(r.span(offset // r.chunk)):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "not a chunk of this file")
        state = await restore.wait_for(r, offset // r.chunk, wait, timeout)
        if state != "ready":
            return state, -1, r.size
        fd = self.ram.open_read(node.ino)
        if os.fstat(fd).st_ino != r.dest:  # replaced or refetched meanwhile
            os.close(fd)
            return "no", -1, r.size
        return "ready", fd, r.size

    # -- fetching from holders -------------------------------------------------------

    def holders_of(self, node: Inode) -> list[Peer]:
        """Live peers holding this version that this host can reach (a host alive for
        the others but not answering this one's pings is not asked): the least busy
        first."""
        peers = [p for h in node.holders if h != self.node_id
                 for p in [self.members.by_node(h)] if p is not None and not p.unreachable]
        random.shuffle(peers)
        return sorted(peers, key=lambda p: p.busy)

    async def download(self, node: Inode, fd: int,
                       on_verified: Callable[[int, int], None]) -> dict[str, int]:
        """Fill fd with the node's current version from its holders; each block is
        reported through on_verified (in this thread) once its crc32c matched.
        Returns the bytes each holder (node id) delivered; raises PeerFetchError when
        no holder could deliver it. Over the data channel, blocks come from every
        holder that offers one at once (striped); else from one holder at a time over
        gRPC, the next resuming where the last stopped."""
        version, size = node.version, node.size
        good = [0]  # bytes from offset 0 verified so far: the next holder resumes there
        errors = []
        peers = self.holders_of(node)
        if not peers:
            # A holder not heard from yet (it started a moment ago, or is back): its
            # broadcast reached us before our next health round; ask now.
            await self.members.check_all(wait=True)
            peers = self.holders_of(node)
        striping = [p for p in peers if p.data_port]
        if self.bulk is not None and striping and size and node.block_crcs:
            delivered = [0]

            def counted(off: int, length: int) -> None:
                delivered[0] += length
                on_verified(off, length)

            failed: dict[str, BaseException] = {}  # holder -> why, on the data channel
            try:
                got = await self._striped(node, fd, striping, counted, failed)
            except OSError as e:
                errors.append(f"data channel: {e}")
                if delivered[0]:
                    # gRPC writes a chunk before verifying it: it must not overwrite
                    # blocks readers were told are good. The caller moves on (bucket).
                    raise PeerFetchError(5, "no peer could deliver it (" + errors[0] + ")"
                                         ) from None
                # A holder that timed out on the data channel (stopped, or cut off) would
                # time out over gRPC too: only the others are asked again.
                stalled = {n for n, x in failed.items()
                           if isinstance(x, (TimeoutError, socket.timeout))}
                peers = [p for p in peers if p.node_id not in stalled]
                self._error(f"fetching {self.ns.path_of(node)} over the data channel: {e}; "
                            "over gRPC instead" + (f" (not from {', '.join(sorted(stalled))}: "
                                                   "no answer)" if stalled else ""))
            else:
                self.stats.fetched_files += 1
                self.stats.fetched_bytes += size
                self.stats.bulk_fetched_bytes += size
                return got
        for p in peers:
            try:
                await self._fetch_from(p, node, fd, version, size, good, on_verified)
            except (grpc.RpcError, IntegrityError, OSError) as e:
                self.stats.fetch_failures += 1
                if isinstance(e, IntegrityError):
                    self.stats.integrity_errors += 1
                why = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError)
                       else str(e))
                errors.append(f"{p.node_id}: {why}")
                self._error(f"fetching {self.ns.path_of(node)} from {p.node_id}: {why}")
                continue
            self.stats.fetched_files += 1
            self.stats.fetched_bytes += size
            return {p.node_id: size}
        raise PeerFetchError(5, "no peer could deliver it (" + ("; ".join(errors) or
                                                                 "no live holder") + ")")

    async def _striped(self, node: Inode, fd: int, holders: list[Peer],
                       on_verified: Callable[[int, int], None],
                       failed: dict[str, BaseException]) -> dict[str, int]:
        """Blocks from every holder at once (mtcfs.peer.striped), each verified (MAC and
        crc32c) before it is written and reported; returns bytes per holder."""
        assert self.bulk is not None
        bulk = self.bulk
        token = trio.lowlevel.current_trio_token()
        guid, version, size = node.guid, node.version, node.size
        path, crcs = self.ns.path_of(node), bytes(node.block_crcs or b"")
        blocks = block_count(size)

        def fetch(p: Peer, first: int, last: int, progress: Progress) -> None:
            def verified(off: int, length: int) -> None:
                progress.next = off // BLOCK + 1
                progress.bytes += length
                # Not waited for: the next block lands meanwhile. Callbacks run in the
                # order queued, and before this thread's end reaches the trio thread.
                token.run_sync_soon(on_verified, off, length)

            bulk.fetch(self._data_addr(p), fd, guid, version, path, size, crcs, first, last,
                       verified)

        for p in holders:
            p.busy += 1
        striped = Striped(fetch, blocks, bulk.connections, self._bulk_limiter,
                          name=lambda p: p.node_id)
        try:
            by = await striped.run(holders)
        finally:
            failed.update(striped.errors)
            for p in holders:
                p.busy -= 1
            for name, e in striped.errors.items():
                self.stats.fetch_failures += 1
                if isinstance(e, IntegrityError):
                    self.stats.integrity_errors += 1
                self._error(f"fetching {path} from {name} over the data channel: "
                            f"{type(e).__name__}: {e}")
        return by

    async def _fetch_from(self, p: Peer, node: Inode, fd: int, version: int, size: int,
                          good: list[int], on_verified: Callable[[int, int], None]) -> None:
        verify = BlockVerifier(size, node.crc32c or 0, node.block_crcs, start=good[0])
        token = trio.lowlevel.current_trio_token()
        prog = _Progress()
        req = pb.FetchRequest(id=node.guid, version=version, offset=verify.offset,
                              path=self.ns.path_of(node))

        def report(off: int, length: int) -> None:
            trio.from_thread.run_sync(on_verified, off, length, trio_token=token)

        def run() -> int:
            # wait_for_ready: a channel still backing off from before the peer was up
            # would fail at once; a peer that stays silent is cut by the watchdog.
            call = p.stub.FetchFile(req, timeout=60 + size / (20 << 20),
                                    metadata=self.members.metadata, wait_for_ready=True)
            prog.call = call
            for chunk in call:
                if chunk.offset != verify.offset:
                    raise IntegrityError(f"chunk at {chunk.offset}, expected {verify.offset}")
                data = chunk.data  # each access of a bytes field copies it
                os.pwrite(fd, data, chunk.offset)
                for off, length in verify.feed(data):
                    report(off, length)
                prog.tick()
            for off, length in verify.finish():
                report(off, length)
            return verify.offset

        p.busy += 1
        try:
            await self._watched(run, prog)
        finally:
            p.busy -= 1
            good[0] = verify.good

    # -- status ----------------------------------------------------------------------

    def _error(self, msg: str) -> None:
        self.stats.last_error = msg
        log.error("%s", msg)

    def status(self) -> dict[str, object]:
        return {
            "listen": self.listen,
            "port": self.port,
            "replicas": self.replicas,
            "failure_domain": self.failure_domain or None,
            "peers": [p.describe() for p in self.members.peers.values()],
            "live_peers": len(self.members.live()),
            "membership": self.members.status(),
            "replication_queue": len(self.repl_queue) + len(self.replicating),
            "replication_pending_bytes": sum(
                n.size for n in {**self.repl_queue, **self.replicating}.values()),
            "quiet": self.quiet(),
            "broadcast_queue": self.broadcaster.pending(),
            "batches_sent": self.broadcaster.stats.batches_sent,
            "entries_sent": self.broadcaster.stats.entries_sent,
            "tree": self.broadcaster.tree_status(),
            "index": self.index.status(),
            "catch_ups": self.catchups.status(),
            "data_port": self.data_port or None,
            "data_channel": self.bulk_server.status() if self.bulk_server is not None else None,
            **{k: v for k, v in vars(self.stats).items() if k != "last_error"},
            "last_error": self.stats.last_error or None,
        }
