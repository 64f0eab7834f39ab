"""What this host answers to the other hosts: the handlers the gRPC service
(mtcfs.peer.server) and the data channel's server (mtcfs.peer.bulk) call, in the
daemon's trio thread unless marked otherwise (mtcfs.peer.server.PeerHandler)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, SEALING, Inode, Namespace
from mtcfs.fs.kernel import KernelCache
from mtcfs.peer import restore, wire
from mtcfs.peer.catchup import CatchUps
from mtcfs.peer.datachannel import DataChannel
from mtcfs.peer.dissemination import Broadcaster, Reply
from mtcfs.peer.index import ReplicatedIndex
from mtcfs.peer.membership import Membership
from mtcfs.peer.reader import PeerReader
from mtcfs.peer.remote import RemoteChanges
from mtcfs.peer.replicator import PeerSettings, Replicator
from mtcfs.peer.server import Refused
from mtcfs.peer.snapshots import Snapshots
from mtcfs.peer.stats import Stats
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.mapped import Pin
from mtcfs.tiers.ram import RamTier


class PeerService:
    def __init__(self, ns: Namespace, ram: RamTier, index: ReplicatedIndex, copies: Copies,
                 events: Listener, members: Membership, kernel: KernelCache,
                 broadcaster: Broadcaster, remote: RemoteChanges, catchups: CatchUps,
                 reader: PeerReader, replicator: Replicator, channel: DataChannel,
                 stats: Stats, settings: PeerSettings) -> None:
        self.ns = ns
        self.ram = ram
        self.index = index
        self.snapshots = Snapshots(index)
        self.copies = copies
        self.events = events
        self.members = members
        self.kernel = kernel
        self.broadcaster = broadcaster
        self.remote = remote
        self.catchups = catchups
        self.reader = reader
        self.replicator = replicator
        self.channel = channel
        self.stats = stats
        self.node_id = settings.node_id
        self.failure_domain = settings.failure_domain

    # -- the index ---------------------------------------------------------------------

    def lamport(self) -> int:
        return self.index.clock

    def gone(self, addresses: list[str], reason: str) -> int:
        """(trio) Word from outside that these hosts are gone: membership probes them."""
        return self.members.gone(addresses, reason)

    def needs_poke(self, listen: str) -> bool:
        return self.members.needs_poke(listen)

    def poke(self, listen: str) -> None:
        self.members.poke(listen)

    def kernel_settle(self, timeout: float) -> bool:
        """(gRPC thread.)"""
        return self.kernel.settle(timeout)

    def on_tree(self, request: pb.TreeMessage, reply: bool = True) -> Reply | None:
        """A batch down a tree, or an ack up it; for a batch, what its handler may
        wait on to answer with the ack (`reply` False: none, a tree stream's)."""
        src, msg = wire.tree_from_pb(request)
        return self.broadcaster.on_message(src, msg, reply)

    def on_batch(self, batch: pb.ChangeBatch) -> int:
        """A batch sent to this host alone (the Broadcast RPC: tools, older daemons);
        applied before the server answers."""
        self.stats.batches_received += 1
        return self.remote.apply(list(batch.entries))

    def snapshot_for(self, from_node: str, listen: str, piece: int, since: float = 0.0
                     ) -> Iterator[list[pb.Entry]]:
        """A peer pulls our snapshot (since > 0: what changed here in the last `since`
        seconds, or all of it if the index cannot tell): it counts for commits from
        now on, before the first piece is made (both in the trio thread); what changes
        while the pieces are made reaches it by broadcast as well."""
        if listen:
            self.members.mark_alive(listen, from_node)
        pieces = self.snapshots.delta(since, piece) if since > 0 else None
        self.stats.snapshots_served += 1
        self.stats.delta_snapshots_served += pieces is not None
        return self._counted(pieces if pieces is not None
                             else self.snapshots.pieces(piece))

    def uncovered(self) -> list[str]:
        """The hosts whose changes a snapshot served now may lack (its coverage)."""
        return self.catchups.uncovered()

    def _counted(self, pieces: Iterator[list[pb.Entry]]) -> Iterator[list[pb.Entry]]:
        for piece in pieces:
            self.stats.snapshot_entries_served += len(piece)
            yield piece

    def health_reply(self) -> pb.HealthReply:
        """(gRPC thread.)"""
        return pb.HealthReply(node_id=self.node_id, lamport=self.index.clock,
                              failure_domain=self.failure_domain,
                              ram_capacity=self.ram.capacity,
                              ram_free=max(0, self.ram.capacity - self.ram.used),
                              entries=len(self.ns.inodes), data_port=self.channel.port)

    # -- replicas received -------------------------------------------------------------

    def begin_receive(self, e: pb.Entry) -> tuple[int, str]:
        node = self.ns.by_global_id(self.index.resolve(e.id))
        if node is not None and node.linked and node.version == e.version and node.has_data:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, "this node already holds it")
        if node is not None and node.linked and node.dirty:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "being rewritten here")
        if self.ram.free < e.size:
            self.events.room_needed(e.size, True)  # persisted data and caches only
        return self.ram.begin_incoming(e.size)

    def finish_receive(self, e: pb.Entry, above: list[pb.Entry], key: int, tmp: str) -> bool:
        # Through RemoteChanges like any entry from a peer: a replica brings its entry,
        # and its directories, before the index does (its writer's change waits for
        # this copy: mtcfs.peer.outbox).
        self.remote.apply([*above, e])
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

    def open_for_fetch(self, guid: str, version: int) -> tuple[int, int]:
        fd, size, _ = self._open_copy(guid, version)
        return fd, size

    def open_to_send(self, guid: str, version: int) -> tuple[int, int, Pin]:
        """open_for_fetch, and a claim to send the file from a mapping of its data
        (mtcfs.tiers.mapped): no shrink of it until the pin is released."""
        fd, size, node = self._open_copy(guid, version)
        return fd, size, self.ram.mapped.pin(node.ino)

    def _open_copy(self, guid: str, version: int) -> tuple[int, int, Inode]:
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
        try:
            return self.ram.open_read(node.ino), size, node
        except FileNotFoundError:  # evicted or removed a moment ago: the reader moves on
            raise Refused(grpc.StatusCode.NOT_FOUND, "no copy here any more") from None

    def held(self) -> list[pb.HeldFile]:
        return [pb.HeldFile(id=n.guid, path=self.ns.path_of(n), version=n.version, size=n.size,
                            crc32c=n.crc32c or 0)
                for n in self.ns.files()
                if n.linked and n.has_data and n.state == CLOSED and not n.dirty]

    def abort_receive(self, key: int, tmp: str) -> None:
        self.ram.abort_incoming(key, tmp)

    def yield_to_writes(self, budget: float) -> float:
        """(A receiving thread.) Pause while this host's trainer writes (bounded)."""
        return self.replicator.yield_to_writes(budget)

    # -- chunks for hosts restoring the same file (mtcfs.peer.restore) -------------------

    async def serve_chunk(self, guid: str, version: int, offset: int, length: int,
                          wait: bool, timeout: float) -> tuple[str, int, int]:
        """A peer restoring the same file asks for a chunk (mtcfs.bulk's `chunk`):
        ("ready", a read fd, size) once it is verified here; ("wait", -1, size) while
        it is still coming (asked again); ("no", -1, size) if it will not come here."""
        node = self.ns.by_global_id(self.index.resolve(guid))
        if node is None or not node.linked or (version and node.version != version):
            raise Refused(grpc.StatusCode.NOT_FOUND, "not this version here")
        r = self.reader.restore_serving(node)
        if r is None:  # done (or replaced): served as a whole copy
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
        try:
            fd = self.ram.open_read(node.ino)
        except FileNotFoundError:  # evicted meanwhile: the requester asks elsewhere
            self.reader.dropped_here(node)
            return "no", -1, r.size
        if os.fstat(fd).st_ino != r.dest:  # replaced or refetched meanwhile
            os.close(fd)
            return "no", -1, r.size
        return "ready", fd, r.size

