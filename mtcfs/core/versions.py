"""Versions: the one writer of what a file's content is.

A file's `state` (open, sealing, closed, incomplete), its `version` and its
checksums (`crc32c`, per-block `block_crcs`, with `sealed_size`) say which bytes
every host, replica and object must hold. They change only here, each change
named for why it happens: a writer starts or closes here, a seal here, another
host's version from the index, the bucket's object, what start-up found in the
RAM dir. Callers record the node and announce the change themselves.
"""

from __future__ import annotations

from mtcfs.core.namespace import CLOSED, INCOMPLETE, OPEN, SEALING, Inode

# The largest file mtcfs checksums, copies to peers and persists (its per-block
# crc32cs take 1 MiB, in the index and on every host). A larger one (sparse: a
# truncate or a write far past the end) is kept as tmpfs keeps it, on the host
# that wrote it only: sealed without checksums, never replicated or uploaded. The
# kernel gives no way to refuse such a write through passthrough (it never asks
# the daemon), so a limit here would only turn it into an error at close.
MAX_SHARED_SIZE = 1 << 40


def too_large_to_share(size: int) -> bool:
    """A file this large is sealed without checksums and kept on its writer's host."""
    return size > MAX_SHARED_SIZE


def local_only(node: Inode) -> bool:
    """A sealed version kept on its writer's host only (larger than MAX_SHARED_SIZE:
    no checksums to verify a copy by)."""
    return node.crc32c is None and too_large_to_share(node.size)


class Versions:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id  # this host: the author of the versions sealed here

    # -- this host writes ------------------------------------------------------------

    @staticmethod
    def writing(node: Inode) -> bool:
        """The first change to a file: open, so that a crash from here on leaves it
        incomplete rather than silently changed. Returns whether the state changed
        (the caller records it)."""
        if node.state == OPEN:
            return False
        node.state = OPEN
        return True

    @staticmethod
    def closing(node: Inode) -> bool:
        """Its last passthrough writer closed it; its checksum is not taken yet (the
        release seals it). Returns whether the state changed."""
        if node.state == SEALING:
            return False
        node.state = SEALING
        return True

    def sealed(self, node: Inode, crc: int | None, blocks: bytes | None) -> bool:
        """Sealed here with these checksums (None: a file too large to share, always a
        new version). Returns whether that is a new version: a write-open that
        changed nothing (same checksums and size, sealed here, not a cache copy)
        keeps its version, whose copies and object stay good."""
        same = (crc is not None and node.version > 0 and node.crc32c == crc
                and node.block_crcs == blocks and node.size == node.sealed_size
                and node.state != INCOMPLETE and not node.cached
                and node.author == self.node_id)
        node.crc32c = crc
        node.block_crcs = blocks
        node.state = CLOSED
        node.sealed_size = node.size
        if not same:
            node.version += 1
        return not same

    # -- start-up ----------------------------------------------------------------------

    @staticmethod
    def recovered(node: Inode, size: int, crc: int | None, blocks: bytes | None,
                  same_version: bool) -> bool:
        """Start-up found the file's data in the RAM dir with these checksums and
        seals it. `same_version`: it was accepted only as its last sealed version.
        Returns whether that is a new version (closed by its writer, its checksum
        not recorded before the daemon stopped, and different)."""
        new = not same_version and (crc is None or not (crc == node.crc32c
                                                         and size == node.size))
        if new:
            node.version += 1
        node.size, node.crc32c, node.block_crcs, node.state = size, crc, blocks, CLOSED
        return new

    @staticmethod
    def interrupted(node: Inode) -> None:
        """It was being written when the daemon stopped and its data changed: never
        served as a good file (open -> EIO until rewritten or removed)."""
        node.state = INCOMPLETE
        node.crc32c = None

    @staticmethod
    def lost(node: Inode) -> None:
        """Sealed, but its only copy (this RAM dir's) is gone: incomplete."""
        node.state = INCOMPLETE

    # -- versions made elsewhere -------------------------------------------------------

    @staticmethod
    def same_content(node: Inode, version: int, size: int, crc: int | None) -> bool:
        """Another host's view names the version this host has."""
        return node.version == version and node.size == size and node.crc32c == crc

    @staticmethod
    def adopted(node: Inode, version: int, size: int, crc: int | None,
                blocks: bytes | None, author: str) -> None:
        """Another host's sealed version, from the replicated index (its data is
        fetched, or replicated, or was here already)."""
        node.size = size
        node.crc32c = crc
        node.version = version
        node.author = author
        node.state = CLOSED
        node.block_crcs = blocks

    @staticmethod
    def from_bucket(node: Inode, size: int, crc: int, replaces: int = 0) -> None:
        """The bucket's object is this file's content. `replaces`: the version of the
        local file it supersedes (the object is newer: one more)."""
        node.state = CLOSED
        node.size = size
        node.crc32c = crc
        node.version = max(node.version, 1, replaces + 1)
