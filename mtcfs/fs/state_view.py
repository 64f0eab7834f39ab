"""What a file's state looks like from this host: `user.mtcfs.state` (JSON) and the
filesystem's part of `mtcfs status`.

A view only: it reads the namespace, the copies and the RAM tier and changes
nothing (but a passthrough-written file's size, refreshed from its RAM file).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mtcfs.core.checksums import format_crc
from mtcfs.core.namespace import CLOSED, INCOMPLETE, OPEN, Inode
from mtcfs.core.versions import local_only

if TYPE_CHECKING:
    from mtcfs.core.copies import Copies
    from mtcfs.fs.filesystem import Filesystem, SpaceManager

STATE_XATTR = b"user.mtcfs.state"


class FileStateView:
    """`fs`: the filesystem it shows (its namespace, RAM tier, handles, counters);
    `copies`, `space` (what is evictable); `step_status`: a step directory's entry
    (None: not a step); `durable_name`: the durable tier in `tiers` ("gcs", "file")."""

    def __init__(self, fs: Filesystem, copies: Copies, space: SpaceManager,
                 step_status: Callable[[Inode], dict[str, Any] | None], *,
                 durable_name: str = "durable") -> None:
        self.fs = fs
        self.ns = fs.ns
        self.ram = fs.ram
        self.copies = copies
        self.space = space
        self.step_status = step_status
        self.node_id = fs.node_id
        self.durable_name = durable_name

    def xattr(self, node: Inode) -> bytes:
        """The value of user.mtcfs.state."""
        return json.dumps(self.state_of(node)).encode()

    def state_of(self, node: Inode) -> dict[str, object]:
        self.fs.sealer.refresh(node)
        if node.is_dir:
            return {"type": "directory", "path": self.ns.path_of(node),
                    **(self.step_status(node) or {})}
        if not node.is_file:
            return {"type": "symlink" if stat.S_ISLNK(node.mode) else "special",
                    "path": self.ns.path_of(node)}
        here = node.has_data and node.state != INCOMPLETE
        st = self._file_state(node, here)
        if node.pt_writers and node.state == CLOSED:
            # Its writer may change it unseen (passthrough): open; the last fsync's
            # version is what other hosts read until it is closed.
            st["state"] = st["lifecycle"] = OPEN
        return st

    def _file_state(self, node: Inode, here: bool) -> dict[str, object]:
        closed = node.state == CLOSED
        holders = list(node.holders) if closed else []
        if here and closed and self.node_id not in holders:
            holders.append(self.node_id)  # e.g. fetched (a cached copy)
        elsewhere = [h for h in holders if h != self.node_id]
        return {
            "state": node.state,
            "path": self.ns.path_of(node),
            "size": node.size,
            "crc32c": format_crc(node.crc32c) if closed else None,
            "version": node.version,
            "holders": holders,
            # Hosts serving it to peers restoring it from the durable tier (cache copies).
            "sources": sorted(node.sources),
            # Peer copies: holders other than the node that wrote this version.
            "replicas": len([h for h in holders if h != (node.author or self.node_id)]),
            "writer": node.author or (self.node_id if node.version else None),
            "persisted": node.persisted,
            "generation": node.generation or None,
            "tiers": [t for t, present in (("ram", here), ("peers", bool(elsewhere)),
                                           (self.durable_name, node.persisted)) if present],
            "lifecycle": self.lifecycle_state(node, here),
        }

    def lifecycle_state(self, node: Inode, here: bool) -> str:
        """Where the file is in its lifecycle (docs/semantics.md), as seen from this host:
        open, incomplete, closed, replicated (K peer copies), persisted, evictable
        (this host's copy may go), evicted (written here, metadata only here now),
        remote (another host's file, not in this host's RAM), local-only (larger
        than MAX_SHARED_SIZE: kept on its writer's host only)."""
        if node.state != CLOSED:
            return node.state
        if local_only(node):
            return "local-only"
        if not here:
            # Written here and dropped: evicted; another host's file: remote.
            return "evicted" if node.author in ("", self.node_id) else "remote"
        if self.copies.droppable(node) and not self.space.busy(node):
            return "evictable"
        if node.persisted:
            return "persisted"
        if self.copies.replicated(node):
            return "replicated"
        return "closed"

    def status(self) -> dict[str, object]:
        files = self.ns.files()
        states: dict[str, int] = {}
        for f in files:
            states[f.state] = states.get(f.state, 0) + 1
        io, seals = self.fs.stats, self.fs.sealer.stats
        return {
            "node_id": self.node_id,
            "ram": {
                "dir": self.ram.root,
                "capacity": self.ram.capacity,
                "used": self.ram.used,
                "free": max(0, self.ram.capacity - self.ram.used),
                "enospc": self.ram.enospc_count,
                "refused": self.ram.refused_incoming,
            },
            "files": len(files),
            "directories": sum(1 for i in self.ns.inodes.values() if i.is_dir),
            "states": states,
            "open_handles": len(self.fs.handles),
            "bytes_written": io.bytes_written,
            "bytes_written_passthrough": seals.bytes_written_passthrough,
            "bytes_read": io.bytes_read,
            "seals": seals.seals,
            "seal_full_passes": seals.seal_full_passes,
        }
