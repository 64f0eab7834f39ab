"""Start-up: re-adopt the RAM dir a previous daemon left.

Files that were being written when it died are checked against their last sealed
version: unchanged, they are sealed again; changed, they are marked incomplete and
never presented as good files (open -> EIO until rewritten or removed). Files
closed through passthrough whose checksum was not recorded yet are sealed now.
Data files without a record (a partial fetch, a crash mid-create) are removed.
"""

from __future__ import annotations

import logging
import os

from mtcfs.core.checksums import block_crcs_of_fd
from mtcfs.core.copies import Copies
from mtcfs.core.namespace import CLOSED, OPEN, SEALING, Inode, Namespace
from mtcfs.core.versions import Versions, too_large_to_share
from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)


def recover(ns: Namespace, ram: RamTier, copies: Copies, versions: Versions) -> None:
    """Re-adopt the RAM dir: files that were being written when the daemon
    died are marked incomplete, never presented as good files."""
    incomplete = 0
    with ns.store.transaction():
        for node in ns.files():
            if node.state == SEALING and ram.exists(node.ino):
                # Closed by its last writer; its checksum was not recorded yet.
                _seal_at_start(ns, ram, copies, versions, node, same_or_incomplete=False)
            elif node.state in (OPEN, SEALING):
                if _seal_at_start(ns, ram, copies, versions, node, same_or_incomplete=True):
                    continue  # opened for writing, but its data never changed
                versions.interrupted(node)
                ns.persist(node)
                incomplete += 1
                log.warning(
                    "file %s was open for writing when the daemon stopped: marked incomplete",
                    ns.path_of(node),
                )
            elif node.state == CLOSED and not node.has_data:
                pass  # in the durable tier only: read through on open
            elif node.state == CLOSED and not ram.exists(node.ino) and node.size > 0:
                copies.lost_at_start(node)
                if not (node.generation or node.holders):  # nor in the bucket, nor on peers
                    versions.lost(node)
                    log.error("file %s lost its data in the RAM dir: marked incomplete",
                              ns.path_of(node))
                ns.persist(node)
    # A partial fetch is dropped: it is fetched again on the next open.
    adopted, orphans = ram.adopt({n.ino for n in ns.files() if n.has_data})
    if adopted or orphans or incomplete:
        log.info("re-adopted %d files from %s (%d incomplete, %d orphaned data files removed)",
                 adopted, ram.root, incomplete, orphans)


def _seal_at_start(ns: Namespace, ram: RamTier, copies: Copies, versions: Versions,
                   node: Inode, same_or_incomplete: bool) -> bool:
    """At start-up, checksum a file's data in RAM. same_or_incomplete: accept it
    only if it is its last sealed version unchanged (an open that never wrote).
    Returns True when the file is sealed."""
    try:
        fd = ram.open_read(node.ino)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        if same_or_incomplete and (not node.version or node.crc32c is None
                                   or size != node.size):
            return False
        if too_large_to_share(size):
            crc, blocks = None, None  # kept here only, unchecksummed (mtcfs.core.versions)
        else:
            crc, blocks = block_crcs_of_fd(fd, size)
    finally:
        os.close(fd)
    if same_or_incomplete and crc != node.crc32c:
        return False
    if versions.recovered(node, size, crc, blocks, same_version=same_or_incomplete):
        copies.sealed_here(node)
    ns.persist(node)
    log.info("sealed %s at start-up (%d bytes)", ns.path_of(node), size)
    return True
