"""What happens to files that several parts of mtcfs react to, in one typed interface.

A part that reacts subclasses `Listener` and overrides the methods it cares
about; the assembly (mtcfs.assembly) registers it with the one `Events` of the
mount, which calls every registered listener in registration order. Whoever
makes a thing happen calls `events.<thing>(...)` and does not know who listens:
no hooks set after construction, no callback attributes.

All calls happen on the daemon's trio thread and must not block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode


class Peer(Protocol):
    """What a membership event says of the peer (mtcfs.peer.membership.Peer is one)."""

    addr: str
    node_id: str


class Listener:
    """No-op defaults: override what concerns you."""

    # -- this host's changes (the filesystem) ----------------------------------------------

    def sealed(self, node: Inode) -> None:
        """A new version of a file was sealed here (its checksum is known)."""

    def resealed(self, node: Inode) -> None:
        """A write-open ended without changing the file: same version, sealed again."""

    def rewriting(self, node: Inode) -> None:
        """A sealed file is being written again here (its next seal makes a version)."""

    def changed(self, nodes: list[Inode]) -> None:
        """Names or attributes changed here that other hosts must see."""

    def removed(self, node: Inode, path: str) -> None:
        """A file's last name at `path` was removed here (unlink, or replaced)."""

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        """A hard-linked file lost the name at `path` here (it keeps others)."""

    def renamed(self, node: Inode, old_path: str) -> None:
        """A file or directory was moved here from `old_path`."""

    def linked(self, node: Inode) -> None:
        """A file got one more name (a hard link) here."""

    # -- copies ------------------------------------------------------------------------------

    def persisted(self, node: Inode) -> None:
        """The durable tier holds the file's current version (this host uploaded or
        copied it, or its bucket listing found it there)."""

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        """A copy of the file's version came or went (`dropped`: this node id's copy
        was evicted); other hosts hear of it."""

    def fetched(self, node: Inode) -> None:
        """A copy of another host's file (or a bucket object) arrived in this RAM tier."""

    def fetch_failed(self, node: Inode, why: str) -> None:
        """No copy of the file could be fetched (no live holder, not in the bucket,
        no room, or every copy failed its checksums)."""

    def copy_wanted(self, node: Inode) -> None:
        """This host needs its own copy of a file it does not hold (to upload it)."""

    def room_needed(self, need: int, safe_only: bool) -> None:
        """Something is about to take `need` bytes of the RAM tier (a replica, a fetch):
        make room now if you can, without waiting. safe_only: only data persisted or
        cached (room for another host's replica)."""

    def fsync_waiting(self, node: Inode, waiting: bool) -> None:
        """An fsync waits (or stopped waiting) for this file's copies: push it first."""

    # -- other hosts -----------------------------------------------------------------------

    def remote_changed(self, nodes: list[Inode]) -> None:
        """Changes from other hosts were applied to these nodes."""

    def remote_moved(self, node: Inode, old_path: str) -> None:
        """Another host moved this node (a rename there) from `old_path`."""

    def remote_removed(self, node: Inode) -> None:
        """Another host's change removed (or replaced) this node here."""

    def peers_changed(self) -> None:
        """A peer came alive, was found dead, or was added or removed."""

    def peer_alive(self, peer: Peer) -> None:
        """A peer answers (again): it is counted, read from and replicated to."""

    def peer_dead(self, peer: Peer) -> None:
        """A peer failed its checks: its copies no longer count."""

    def peer_ready(self, peer: Peer) -> None:
        """A live peer says it is caught up (its index is whole) where it did not."""

    def peer_restarted(self, peer: Peer) -> None:
        """A live peer is a new process (seen before any death of it was)."""


class Events(Listener):
    """The mount's dispatcher: calls each registered listener in turn."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def register(self, *listeners: Listener) -> None:
        self._listeners.extend(listeners)

    def sealed(self, node: Inode) -> None:
        for x in self._listeners:
            x.sealed(node)

    def resealed(self, node: Inode) -> None:
        for x in self._listeners:
            x.resealed(node)

    def rewriting(self, node: Inode) -> None:
        for x in self._listeners:
            x.rewriting(node)

    def changed(self, nodes: list[Inode]) -> None:
        for x in self._listeners:
            x.changed(nodes)

    def removed(self, node: Inode, path: str) -> None:
        for x in self._listeners:
            x.removed(node, path)

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        for x in self._listeners:
            x.name_removed(node, path, was_own)

    def renamed(self, node: Inode, old_path: str) -> None:
        for x in self._listeners:
            x.renamed(node, old_path)

    def linked(self, node: Inode) -> None:
        for x in self._listeners:
            x.linked(node)

    def persisted(self, node: Inode) -> None:
        for x in self._listeners:
            x.persisted(node)

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        for x in self._listeners:
            x.copies_changed(node, dropped)

    def fetched(self, node: Inode) -> None:
        for x in self._listeners:
            x.fetched(node)

    def fetch_failed(self, node: Inode, why: str) -> None:
        for x in self._listeners:
            x.fetch_failed(node, why)

    def copy_wanted(self, node: Inode) -> None:
        for x in self._listeners:
            x.copy_wanted(node)

    def room_needed(self, need: int, safe_only: bool) -> None:
        for x in self._listeners:
            x.room_needed(need, safe_only)

    def fsync_waiting(self, node: Inode, waiting: bool) -> None:
        for x in self._listeners:
            x.fsync_waiting(node, waiting)

    def remote_changed(self, nodes: list[Inode]) -> None:
        for x in self._listeners:
            x.remote_changed(nodes)

    def remote_moved(self, node: Inode, old_path: str) -> None:
        for x in self._listeners:
            x.remote_moved(node, old_path)

    def remote_removed(self, node: Inode) -> None:
        for x in self._listeners:
            x.remote_removed(node)

    def peers_changed(self) -> None:
        for x in self._listeners:
            x.peers_changed()

    def peer_alive(self, peer: Peer) -> None:
        for x in self._listeners:
            x.peer_alive(peer)

    def peer_dead(self, peer: Peer) -> None:
        for x in self._listeners:
            x.peer_dead(peer)

    def peer_ready(self, peer: Peer) -> None:
        for x in self._listeners:
            x.peer_ready(peer)

    def peer_restarted(self, peer: Peer) -> None:
        for x in self._listeners:
            x.peer_restarted(peer)
