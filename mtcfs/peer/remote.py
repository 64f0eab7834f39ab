"""Other hosts' changes applied here: around the namespace (the kernel's caches,
this host's stale data, its replication queue, the parts that react to remote
changes), and batches as the tree delivers them."""

from __future__ import annotations

from mtcfs.core.events import Listener
from mtcfs.core.namespace import Inode
from mtcfs.fs.kernel import KernelCache
from mtcfs.peer.catchup import Markers
from mtcfs.peer.index import Hooks, ReplicatedIndex
from mtcfs.peer.replicator import ReplicationQueue
from mtcfs.peer.stats import Stats
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.ram import RamTier


class IndexHooks(Hooks):
    """What applying another host's change does around the namespace."""

    def __init__(self, ram: RamTier, kernel: KernelCache, events: Listener,
                 queue: ReplicationQueue) -> None:
        self.ram = ram
        self.kernel = kernel
        self.events = events
        self.queue = queue

    def forget_data(self, node: Inode) -> None:
        self.queue.drop(node)  # a version written elsewhere: this one needs no copies
        self.ram.remove(node.ino)

    def invalidate(self, parent: Inode, name: bytes, node: Inode | None) -> None:
        self.kernel.entry(parent.ino, name)

    def removed(self, node: Inode) -> None:
        self.queue.drop(node)
        self.events.remote_removed(node)

    def moved(self, node: Inode, old_path: str) -> None:
        self.events.remote_moved(node, old_path)

    def attrs_changed(self, node: Inode) -> None:
        self.kernel.attrs(node.ino)


class RemoteChanges:
    """Entries from other hosts (batches, snapshots, a pushed replica's entry) into
    the index; the parts that react hear of what changed."""

    def __init__(self, index: ReplicatedIndex, events: Listener, node_id: str) -> None:
        self.index = index
        self.events = events
        self.node_id = node_id
        self.missing_here: dict[int, Inode] = {}  # listed as held here, no copy here

    def apply(self, entries: list[pb.Entry]) -> int:
        """Returns how many changed this host's index."""
        n = self.index.apply(entries)
        if self.index.touched:
            self.events.remote_changed(self.index.touched)
        for node in self.index.disowned:
            # Listed as a holder of a copy this host does not have (a replacement with
            # the same node id, or one that evicted it): readers must not ask us.
            self.index.holders_changed(node, dropped=self.node_id)
            self.missing_here[node.ino] = node
        return n

    def missing_copies(self) -> list[Inode]:
        """Files the job listed this host as holding while it had no copy (what a
        replacement host restores in the background: mtcfs.lifecycle.replacement)."""
        return list(self.missing_here.values())


class Inbox:
    """Batches the dissemination tree delivers here: applied, and a catch-up marker
    handed on to CatchUps (through `markers`)."""

    def __init__(self, remote: RemoteChanges, markers: Markers, stats: Stats) -> None:
        self.remote = remote
        self.markers = markers
        self.stats = stats

    def deliver(self, batch: pb.ChangeBatch) -> None:
        self.stats.batches_received += 1
        self.remote.apply(list(batch.entries))
        if batch.HasField("caught_up"):
            self.markers.put(batch.from_node, batch.caught_up.hosts,
                             batch.caught_up.since_unix)
