"""The peer tier: this host's part in the job's one filesystem, as parts with one
role each, built here in dependency order (`build_peer_tier`):

- the replicated index (mtcfs.peer.index) puts this host's changes into an
  `Outbox`; the `Broadcaster` (mtcfs.peer.dissemination) sends them in batches
  down a tree of the live hosts and delivers other hosts' batches to the `Inbox`
  (mtcfs.peer.remote), which applies them;
- the `Replicator` (mtcfs.peer.replicator) pushes each sealed file to K peers,
  in the background, over the data channel or gRPC, yielding to the trainer;
- the `PeerReader` (mtcfs.peer.reader) fetches other hosts' copies for this
  host's readers (mtcfs.fetch drives it), striped over all holders, or restores
  them from the bucket together with the other hosts reading them;
- the `PeerService` (mtcfs.peer.service) answers the other hosts, behind the gRPC
  server (mtcfs.peer.server) and the data channel's (mtcfs.peer.bulk);
- `Join`, `SnapshotPuller` and `CatchUps` (mtcfs.peer.join, .catchup) bring this
  host up to date when it starts and when hosts come back.

`PeerTier` is what the rest of the mount sees: a Listener that hands this host's
events to those parts, starts and stops them, and reports their status.
Runs in the daemon's trio thread; blocking calls run in worker threads.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import trio

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import Inode, Namespace
from mtcfs.core.retired import RetiredSteps
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.writeclock import WriteClock
from mtcfs.peer import grouped
from mtcfs.peer.catchup import CatchUps, Markers
from mtcfs.peer.datachannel import DataChannel
from mtcfs.peer.dissemination import BROADCAST_TIMEOUT, Broadcaster, TreeCalls
from mtcfs.peer.index import ReplicatedIndex
from mtcfs.peer.join import MAX_BATCH, Join, LaterRows, SnapshotPuller
from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.outbox import Outbox
from mtcfs.peer.reader import PeerReader
from mtcfs.peer.remote import Inbox, IndexHooks, RemoteChanges
from mtcfs.peer.replicator import (
    PeerSettings,
    ReplicationQueue,
    Replicator,
    Transfers,
)
from mtcfs.peer.server import start_server
from mtcfs.peer.service import PeerService
from mtcfs.peer.stats import PeerFetchError, Stats
from mtcfs.peer.treelinks import TreeLinks
from mtcfs.tiers.durable import DurableTier
from mtcfs.tiers.ram import RamTier

__all__ = ["BROADCAST_TIMEOUT", "MAX_BATCH", "PeerFetchError", "PeerSettings", "PeerTier",
           "build_peer_tier"]


class _NotServing:
    """The gRPC server before start."""

    def stop(self, grace: float | None) -> None:
        pass


class PeerTier(Listener):
    def __init__(self, settings: PeerSettings, members: Membership,
                 index: ReplicatedIndex, broadcaster: Broadcaster, catchups: CatchUps,
                 join: Join, replicator: Replicator, reader: PeerReader,
                 service: PeerService, remote: RemoteChanges, channel: DataChannel,
                 transfers: Transfers, stats: Stats, later: LaterRows) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.members = members
        self.index = index
        self.broadcaster = broadcaster
        self.catchups = catchups
        self.join = join
        self.replicator = replicator
        self.reader = reader
        self.service = service
        self.remote = remote
        self.channel = channel
        self.transfers = transfers
        self.stats = stats
        self.later = later  # writes the index rows pulled snapshots left for later
        self.server: grpc.Server | _NotServing = _NotServing()
        self.port = 0
        self._started = False

    @property
    def data_port(self) -> int:
        return self.channel.port

    # -- start-up --------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Listen, make every configured peer hear of this host (each answers: from then
        on it counts this host for its commits), learn the others' view from one of
        them, and pull ONE live, caught-up host's snapshot (bounded by the commit
        timeout): before the mount is announced live, so a new host sees the whole tree
        at once, and what is committed after the snapshot reaches it by broadcast."""
        s = self.settings
        token = trio.lowlevel.current_trio_token()
        self.server, self.port = start_server(self.service, s.listen, token, s.secret, s.tls,
                                              file_bytes=self.transfers.grpc_bytes)
        me = self.members.local
        me.data_port = self.channel.start(self.service, token)
        me.ram_free = self.members.ram.free
        me.ready = False
        self.members.open()
        nursery.start_soon(self.members.run)
        # Batches reach this host while it joins: their acks must not wait for it.
        nursery.start_soon(self.broadcaster.run)
        await self.join.run()
        me.ready = True
        self._started = True
        nursery.start_soon(self.later.run)
        self.catchups.start(nursery)
        self.replicator.start(nursery)

    def stop(self) -> None:
        self.replicator.stop()
        self.server.stop(grace=0.5)
        self.broadcaster.stop()
        self.channel.stop()
        self.members.close()

    # -- membership (Listener) --------------------------------------------------------

    def peer_alive(self, peer: Peer) -> None:
        if peer.ready:
            self.catchups.back(peer, self.members.incarnation_of(peer.addr))
        # (Not ready: starting, it takes our changes and has none of its own; or back
        # by gossip before it spoke to us: caught up with once it says it is ready.)
        self.replicator.requeue()

    def peer_restarted(self, peer: Peer) -> None:
        self.broadcaster.restarted(peer.addr)
        self.index.announce_replicas_of(peer.node_id)

    def peer_ready(self, peer: Peer) -> None:
        if peer.addr in self.catchups.owed:  # back by gossip before it spoke to us
            self.catchups.back(peer, self.members.incarnation_of(peer.addr))

    def peer_dead(self, peer: Peer) -> None:
        if self._started:
            self.catchups.dead(peer, self.members.incarnation_of(peer.addr))
        self.index.announce_replicas_of(peer.node_id)
        self.replicator.requeue()

    def peers_changed(self) -> None:
        self.broadcaster.kick()

    def hosts_accounted(self) -> bool:
        """Every host of the job is alive and caught up with, or gone for good: what a
        host cut off for a moment wrote meanwhile is known here (commit markers wait)."""
        return self.catchups.accounted() and self.members.all_accounted()

    # -- this host's changes (Listener) ----------------------------------------------

    def sealed(self, node: Inode) -> None:
        self.index.changed(node)
        self.replicator.sealed(node)

    def resealed(self, node: Inode) -> None:
        self.index.changed(node)

    def changed(self, nodes: list[Inode]) -> None:
        self.index.changed(*nodes)

    def linked(self, node: Inode) -> None:
        self.index.changed(node)

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        self.index.changed(node)

    def removed(self, node: Inode, path: str) -> None:
        self.replicator.queue.drop(node)
        self.index.removed(node)

    def persisted(self, node: Inode) -> None:
        self.index.holders_changed(node)

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        """A copy came or went (a replica the Replicator made, recorded by Copies, is
        one of them): the other hosts hear of it through the index."""
        if dropped == self.node_id:
            # Evicted here: no longer a source of its chunks for hosts restoring it.
            self.reader.dropped_here(node)
        if node.generation:  # a bucket object: maybe restored here (its sources change)
            self.index.sources_changed(node, dropped=dropped)
        else:
            self.index.holders_changed(node, dropped=dropped)

    def fsync_waiting(self, node: Inode, waiting: bool) -> None:
        self.replicator.fsync_waiting(node, waiting)

    # -- what the other parts of the mount ask -----------------------------------------

    def busy(self, node: Inode) -> bool:
        """Being pushed now (mtcfs.lifecycle.space's Activity)."""
        return self.replicator.busy(node)

    def settling(self) -> bool:
        """Replication in flight or queued (it can make data evictable)."""
        return bool(self.replicator.replicas and self.members.live() and not self.quiet())

    def quiet(self) -> bool:
        """Nothing waiting to be broadcast or replicated."""
        return self.broadcaster.quiet() and self.replicator.queue.empty()

    async def wait_applied(self, what: str, node: Inode | None = None) -> list[str]:
        """The commit rule: return once every live peer has applied everything this
        host published so far (and `node`'s directories, which another host may have
        made), or after --commit-timeout."""
        if node is not None:
            self.index.publish_ancestors(node)
        return await self.broadcaster.wait_applied(what)

    def missing_copies(self) -> list[Inode]:
        return self.remote.missing_copies()

    async def download(self, node: Inode, fd: int, on_verified: Callable[[int, int], None],
                       focus: Callable[[], int | None] = lambda: None) -> dict[str, int]:
        return await self.reader.download(node, fd, on_verified, focus)

    async def restore(self, node: Inode, fd: int, tier: DurableTier, key: str,
                      generation: int, parallel: int,
                      on_verified: Callable[[int, int], None]) -> dict[str, int] | None:
        return await self.reader.restore(node, fd, tier, key, generation, parallel,
                                         on_verified)

    # -- status ----------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        s, queue = self.settings, self.replicator.queue
        return {
            "listen": s.listen,
            "port": self.port,
            "replicas": s.replicas,
            "failure_domain": s.failure_domain or None,
            "peers": [p.describe() for p in self.members.peers.values()],
            "live_peers": len(self.members.live()),
            "membership": self.members.status(),
            "replication_queue": len(queue.waiting) + len(queue.running),
            "replication_pending_bytes": sum(n.size for n in queue.files()),
            "quiet": self.quiet(),
            "broadcast_queue": self.broadcaster.pending(),
            "batches_sent": self.broadcaster.stats.batches_sent,
            "entries_sent": self.broadcaster.stats.entries_sent,
            "tree": self.broadcaster.tree_status(),
            "index": self.index.status(),
            "catch_ups": self.catchups.status(),
            "data_port": self.channel.port or None,
            "data_channel": self.channel.status(),
            **self.stats.counters(),
            "last_error": self.stats.last_error or None,
        }


def build_peer_tier(ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                    kernel: KernelCache, members: Membership, clock: WriteClock,
                    retired: RetiredSteps, settings: PeerSettings,
                    channel: DataChannel) -> PeerTier:
    """The peer tier's parts in dependency order, each given its collaborators:
    nothing is wired after construction. `channel`: the data channel (NoDataChannel:
    file bytes over gRPC only)."""
    stats = Stats()
    transfers = Transfers.of(settings, channel)
    node_id = settings.node_id
    outbox = Outbox()  # the index puts, the broadcaster takes
    queue = ReplicationQueue()
    index = ReplicatedIndex(ns, node_id, IndexHooks(ram, kernel, events, queue), copies,
                            outbox=outbox)
    remote = RemoteChanges(index, events, node_id)
    markers = Markers()  # the inbox puts, CatchUps takes
    trees = TreeLinks(members, channel, TreeCalls(members))  # by gRPC where no stream
    broadcaster = Broadcaster(members, node_id, index, outbox, trees,
                              Inbox(remote, markers, stats), kernel, settings.commit_timeout,
                              group=settings.peer_group,
                              turn=grouped.wall_turn(settings.peer_group_turn))
    later = LaterRows(ns.store)
    puller = SnapshotPuller(members, remote, outbox, stats, settings, transfers, later)
    # Peers found dead since we started, caught up with once they are back.
    catchups = CatchUps(members.me, members, puller, broadcaster, events, markers)
    reader = PeerReader(ns, members, copies, channel, stats, settings, transfers)
    replicator = Replicator(ns, ram, copies, members, clock, retired, index, broadcaster,
                            channel, queue, stats, settings, transfers)
    service = PeerService(ns, ram, index, copies, events, members, kernel, broadcaster,
                          remote, catchups, reader, replicator, channel, stats, settings)
    return PeerTier(settings, members, index, broadcaster, catchups,
                    Join(members, puller, settings.commit_timeout), replicator, reader,
                    service, remote, channel, transfers, stats, later)
