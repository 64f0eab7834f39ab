"""The namespace: inodes and directory entries, in memory, written through to
the metadata store.

Every lookup and listing is served from memory. An inode has one name it is
known by (`parent`, `name`: its path, the key peers and the durable tier use)
and, when hard-linked, further names (`links`); directories have exactly one.
"""

from __future__ import annotations

import logging
import stat
import time
import uuid
from dataclasses import dataclass, field

from mtcfs.core.store import InodeRow, MetaStore, Params

log = logging.getLogger(__name__)

ROOT = 1
ROOT_GUID = "root"

# Per-file states (docs/semantics.md, "A file's life"). Directories and symlinks: none.
OPEN = "open"  # being written; content not yet sealed
SEALING = "sealing"  # closed by its last writer, crc32c being computed (passthrough)
CLOSED = "closed"  # sealed, crc32c known
INCOMPLETE = "incomplete"  # was open when the daemon died: never served


@dataclass(eq=False, slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    parent: int
    name: bytes
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0
    target: bytes | None = None
    state: str = ""
    crc32c: int | None = None
    version: int = 0
    persisted_version: int = 0
    generation: int = 0
    has_data: bool = True
    # Replicated index (mtcfs.peer.index): global id, last change's stamp,
    # nodes holding this version, per-block crc32cs.
    guid: str = ""
    lamport: int = 0
    writer: str = ""  # (lamport, writer): the last change's stamp (any change)
    author: str = ""  # the node that sealed this data version (not changed by a rename)
    holders: list[str] = field(default_factory=list)
    block_crcs: bytes | None = None
    # Hard links: names besides (parent, name), in the order they were made.
    links: list[tuple[int, bytes]] = field(default_factory=list)
    children: dict[bytes, int] | None = None
    subdirs: int = 0
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    linked: bool = True
    # Runtime only: kernel lookup count, open handles, writers.
    lookups: int = 0
    opens: int = 0
    writers: int = 0
    dirty: bool = False
    cached: bool = False  # the data here was read through (a cache copy, not a replica)
    # Hosts that read this persisted version through and serve it to peers (restoring
    # it, or done): never counted as copies (mtcfs.peer.restore). Not recorded: soft.
    sources: list[str] = field(default_factory=list)
    last_access: float = 0.0  # time.monotonic() of the last open: caches are evicted LRU
    wseq: int = 0  # bumped by every write/truncate, to detect races with a seal
    # Removed or replaced by another host's (or the bucket's) change: a name the kernel
    # still caches for it is stale, and open/stat answer ESTALE so that the kernel
    # looks the path up again (and finds the new file, or none).
    stale: bool = False
    copy_grace: float = 0.0  # another host copies it under its new name until then
    pt_writers: int = 0  # handles writing through passthrough (unseen by the daemon)
    pt_changed: bool = False  # a passthrough writer was open since the last final seal
    ram_mtime_ns: int = 0  # the RAM file's mtime when its size/mtime were last taken
    fsynced: bool = False  # fsync'd since opened: its close waits until peers have it
    sealed_size: int = 0  # size of the last sealed version (served while rewritten)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def persisted(self) -> bool:
        return self.is_file and self.state == CLOSED and self.persisted_version == self.version

    @property
    def nlink(self) -> int:
        if not self.linked:
            return 0  # removed (rmdir, unlink, replaced by rename) but still open
        return 2 + self.subdirs if self.is_dir else 1 + len(self.links)

    def names(self) -> list[tuple[int, bytes]]:
        """Every (parent ino, name) this inode is reachable by, its own first."""
        return [(self.parent, self.name), *self.links] if self.linked else []

    def row(self) -> InodeRow:
        r = InodeRow(*self.params())  # type: ignore[arg-type]
        r.has_data = bool(r.has_data)
        return r

    def params(self) -> Params:
        """The store's row of this inode (MetaStore.put_node): a plain tuple, as
        thousands are made per snapshot applied."""
        return (
            self.ino,
            self.mode,
            self.uid,
            self.gid,
            self.size,
            self.atime_ns,
            self.mtime_ns,
            self.ctime_ns,
            self.rdev,
            self.target,
            # A file open for writing through passthrough may change unseen: recorded as
            # open, so a crash leaves it incomplete unless its data is its sealed version.
            OPEN if self.pt_writers and self.state == CLOSED else self.state,
            self.crc32c,
            self.version,
            self.persisted_version,
            self.generation,
            int(self.has_data),
            self.guid,
            self.lamport,
            self.writer,
            ",".join(self.holders),
            self.block_crcs,
            self.author,
            self.parent if self.linked and self.ino != ROOT else 0,
            self.name,
        )


class Namespace:
    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self.inodes: dict[int, Inode] = {}
        self.by_guid: dict[str, int] = {}
        self.next_ino = ROOT + 1
        self._load()

    # -- startup ---------------------------------------------------------------

    def _load(self) -> None:
        rows = {r.ino: r for r in self.store.load_inodes()}
        if ROOT not in rows:
            now = time.time_ns()
            root = Inode(ROOT, stat.S_IFDIR | 0o755, 0, 0, ROOT, b"", 0, now, now, now)
            root.children = {}
            root.guid = ROOT_GUID
            self.inodes[ROOT] = root
            self.by_guid[ROOT_GUID] = ROOT
            with self.store.transaction():
                self._put(root)
            return
        for r in rows.values():
            ino = Inode(
                r.ino, r.mode, r.uid, r.gid, 0, b"", r.size, r.atime_ns, r.mtime_ns,
                r.ctime_ns, r.rdev, r.target, r.state, r.crc32c, r.version,
                r.persisted_version, r.generation, r.has_data, r.guid or new_guid(),
                r.lamport, r.writer, r.author,
                [h for h in r.holders.split(",") if h], r.block_crcs,
            )
            ino.sealed_size = r.size
            if r.ino == ROOT:
                ino.guid = ROOT_GUID
            self.by_guid[ino.guid] = r.ino
            if ino.is_dir:
                ino.children = {}
            self.inodes[r.ino] = ino
        self.inodes[ROOT].parent = ROOT
        reached = {ROOT}
        for r in rows.values():  # by inode number (a clash: the older keeps the name)
            p, c = self.inodes.get(r.parent), self.inodes[r.ino]
            if r.ino == ROOT or p is None or p.children is None or r.name in p.children:
                continue  # no name of its own (unlinked while open): an orphan, below
            p.children[r.name] = r.ino
            c.parent, c.name = r.parent, r.name
            reached.add(r.ino)
            if c.is_dir:
                p.subdirs += 1
        broken = []
        for parent, name, child in self.store.load_links():
            p, c = self.inodes.get(parent), self.inodes.get(child)
            if (p is None or c is None or p.children is None or c.is_dir
                    or name in p.children):
                broken.append((parent, name))
                continue
            p.children[name] = child
            if child in reached:
                c.links.append((parent, name))
            else:  # (not written so: _detach makes a further name the own one)
                c.parent, c.name = parent, name
                reached.add(child)
        for ino_, name, value in self.store.load_xattrs():
            if ino_ in self.inodes:
                self.inodes[ino_].xattrs[name] = value
        # Inodes no entry points at were unlinked while open when the daemon died.
        with self.store.transaction():
            for parent, name in broken:
                self.store.delete_link(parent, name)
            for r in rows.values():
                if not r.guid and r.ino in self.inodes:
                    self._put(self.inodes[r.ino])  # ids from before schema 3
            for orphan in set(self.inodes) - reached:
                self.store.delete_inode(orphan)
                self.by_guid.pop(self.inodes.pop(orphan).guid, None)
        self.next_ino = max(self.inodes) + 1

    # -- queries ---------------------------------------------------------------

    def get(self, ino: int) -> Inode | None:
        return self.inodes.get(ino)

    def by_global_id(self, guid: str) -> Inode | None:
        ino = self.by_guid.get(guid)
        return None if ino is None else self.inodes.get(ino)

    def child(self, parent: Inode, name: bytes) -> Inode | None:
        assert parent.children is not None
        ino = parent.children.get(name)
        return None if ino is None else self.inodes[ino]

    def path_of(self, node: Inode) -> str:
        """The path relative to the mount root, e.g. 'step_100/shard_0.distcp'."""
        parts: list[bytes] = []
        while node.ino != ROOT:
            parts.append(node.name)
            node = self.inodes[node.parent]
        return b"/".join(reversed(parts)).decode("utf-8", "surrogateescape")

    def path_at(self, parent: Inode, name: bytes) -> str:
        """The path of `name` in directory `parent`."""
        d = self.path_of(parent)
        n = name.decode("utf-8", "surrogateescape")
        return f"{d}/{n}" if d else n

    def link_paths(self, node: Inode) -> list[str]:
        """The paths of a hard-linked file's further names (see Inode.links)."""
        return [self.path_at(self.inodes[p], n) for p, n in node.links]

    def is_ancestor(self, maybe_ancestor: Inode, node: Inode) -> bool:
        while True:
            if node.ino == maybe_ancestor.ino:
                return True
            if node.ino == ROOT:
                return False
            node = self.inodes[node.parent]

    def files(self) -> list[Inode]:
        return [i for i in self.inodes.values() if i.is_file]

    # -- changes (each written through to the store) ---------------------------

    def new_inode(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int,
                  target: bytes | None = None, rdev: int = 0, global_id: str = "") -> Inode:
        # (Kept lean: a joining host makes hundreds of thousands from a snapshot.)
        now = time.time_ns()
        ino = self.next_ino
        self.next_ino = ino + 1
        node = Inode(ino, mode, uid, gid, parent.ino, name, 0, now, now, now, rdev, target)
        guid = node.guid = global_id or new_guid()
        self.by_guid[guid] = ino
        if stat.S_ISDIR(mode):
            node.children = {}
        elif stat.S_ISREG(mode):
            node.state = OPEN
        if target is not None:
            node.size = len(target)
        self.inodes[ino] = node
        if self.store.depth:  # within a transaction already (a batch from a peer)
            self._add_name(parent, name, node, now)
            return node
        with self.store.transaction():
            self._add_name(parent, name, node, now)
        return node

    def _add_name(self, parent: Inode, name: bytes, node: Inode, now: int) -> None:
        """A new node's row (its own name in it: Namespace._attach for a node that has
        none yet)."""
        self._put(node)
        assert parent.children is not None
        parent.children[name] = node.ino
        if node.children is not None:
            parent.subdirs += 1
        self._touch_dir(parent, now)

    def persist(self, node: Inode) -> None:
        self._put(node)

    def _put(self, node: Inode) -> None:
        """Write the node's row (in a coalescing transaction: its state at the end)."""
        self.store.put_node(node.ino, node.params, node.children is not None)

    def _attach(self, parent: Inode, name: bytes, node: Inode) -> None:
        """Add the name: the node's own if it has none, else a further (hard) link."""
        assert parent.children is not None
        parent.children[name] = node.ino
        alias = node.linked and not node.is_dir and (node.parent, node.name) != (parent.ino, name)
        if alias:
            node.links.append((parent.ino, name))
            self.store.put_link(parent.ino, name, node.ino)
        else:
            node.parent, node.name, node.linked = parent.ino, name, True
            self._put(node)
        if node.is_dir:
            parent.subdirs += 1

    def _detach(self, parent: Inode, name: bytes) -> Inode:
        """Remove the name; a hard-linked node keeps its other names (the oldest
        further link becomes the name it is known by)."""
        assert parent.children is not None
        node = self.inodes[parent.children.pop(name)]
        if (node.parent, node.name) == (parent.ino, name):
            if node.links:
                node.parent, node.name = node.links.pop(0)
                self.store.delete_link(node.parent, node.name)  # now its own name
            else:
                node.linked = False
            self._put(node)
        else:
            node.links.remove((parent.ino, name))
            self.store.delete_link(parent.ino, name)
        if node.is_dir:
            parent.subdirs -= 1
        return node

    def _move(self, old_parent: Inode, old_name: bytes, new_parent: Inode, new_name: bytes,
              node: Inode) -> None:
        """Rename one of the node's names in place (its own name stays its own)."""
        assert old_parent.children is not None and new_parent.children is not None
        if old_parent.children.get(old_name) == node.ino:
            del old_parent.children[old_name]
        new_parent.children[new_name] = node.ino
        if (node.parent, node.name) == (old_parent.ino, old_name):
            node.parent, node.name = new_parent.ino, new_name
            self._put(node)
        else:
            node.links[node.links.index((old_parent.ino, old_name))] = (new_parent.ino, new_name)
            self.store.delete_link(old_parent.ino, old_name)
            self.store.put_link(new_parent.ino, new_name, node.ino)
        if node.is_dir and old_parent is not new_parent:
            old_parent.subdirs -= 1
            new_parent.subdirs += 1

    def _touch_dir(self, d: Inode, now: int) -> None:
        d.mtime_ns = d.ctime_ns = now
        self._put(d)

    def unlink(self, parent: Inode, name: bytes) -> Inode:
        """Remove the entry; the caller drops the inode when nothing uses it."""
        now = time.time_ns()
        with self.store.transaction():
            node = self._detach(parent, name)
            node.ctime_ns = now
            self._touch_dir(parent, now)
        return node

    def drop(self, node: Inode) -> None:
        self.store.delete_inode(node.ino)
        self.inodes.pop(node.ino, None)
        if self.by_guid.get(node.guid) == node.ino:
            del self.by_guid[node.guid]

    def rename(self, old_parent: Inode, old_name: bytes, new_parent: Inode, new_name: bytes,
               exchange: bool = False) -> Inode | None:
        """Move an entry; returns the inode it replaced (that name removed), if any."""
        now = time.time_ns()
        assert old_parent.children is not None and new_parent.children is not None
        with self.store.transaction():
            node = self.inodes[old_parent.children[old_name]]
            replaced = None
            if exchange:
                other = self.inodes[new_parent.children[new_name]]
                del new_parent.children[new_name]
                self._move(old_parent, old_name, new_parent, new_name, node)
                # `other` takes the old name (its entry in new_parent is gone already).
                new_parent.children[new_name] = node.ino
                old_parent.children[old_name] = other.ino
                # Each name's row: an own name is in its inode's row (both written
                # below), a further name in a link row of its own.
                self.store.delete_link(old_parent.ino, old_name)
                self.store.delete_link(new_parent.ino, new_name)
                if (node.parent, node.name) != (new_parent.ino, new_name):
                    self.store.put_link(new_parent.ino, new_name, node.ino)
                if (other.parent, other.name) == (new_parent.ino, new_name):
                    other.parent, other.name = old_parent.ino, old_name
                else:
                    other.links[other.links.index((new_parent.ino, new_name))] = (
                        old_parent.ino, old_name)
                    self.store.put_link(old_parent.ino, old_name, other.ino)
                if other.is_dir and old_parent is not new_parent:
                    new_parent.subdirs -= 1
                    old_parent.subdirs += 1
                other.ctime_ns = now
                self._put(other)
            else:
                if new_name in new_parent.children:
                    replaced = self._detach(new_parent, new_name)
                    replaced.ctime_ns = now
                    if replaced.linked:
                        self._put(replaced)
                self._move(old_parent, old_name, new_parent, new_name, node)
            node.ctime_ns = now
            self._put(node)
            self._touch_dir(old_parent, now)
            if new_parent is not old_parent:
                self._touch_dir(new_parent, now)
        return replaced

    def link(self, node: Inode, parent: Inode, name: bytes) -> None:
        """A further name for a (non-directory) node: a hard link."""
        now = time.time_ns()
        with self.store.transaction():
            self._attach(parent, name, node)
            node.ctime_ns = now
            self._put(node)
            self._touch_dir(parent, now)

    def replace_inode(self, old: Inode, global_id: str) -> tuple[Inode, list[tuple[Inode, bytes]]]:
        """New content for a file, made elsewhere: a new inode at its name (same mode,
        owner and extended attributes, a new global id); `old` loses every name and is
        stale. Returns the new inode and the (directory, name) pairs `old` lost."""
        parent, name = self.inodes[old.parent], old.name
        names = self.unlink_all(old)
        old.stale = True
        node = self.new_inode(parent, name, old.mode, old.uid, old.gid, global_id=global_id)
        node.xattrs = dict(old.xattrs)
        with self.store.transaction():
            for key, value in node.xattrs.items():
                self.store.put_xattr(node.ino, key, value)
        return node, names

    def unlink_all(self, node: Inode) -> list[tuple[Inode, bytes]]:
        """Remove every name of the node; returns the (directory, name) pairs removed."""
        removed = [(self.inodes[p], n) for p, n in node.names()]
        for d, n in removed:
            self.unlink(d, n)
        return removed

    def set_xattr(self, node: Inode, name: bytes, value: bytes) -> None:
        node.xattrs[name] = value
        node.ctime_ns = time.time_ns()
        with self.store.transaction():
            self.store.put_xattr(node.ino, name, value)
            self._put(node)

    def remove_xattr(self, node: Inode, name: bytes) -> None:
        del node.xattrs[name]
        node.ctime_ns = time.time_ns()
        with self.store.transaction():
            self.store.delete_xattr(node.ino, name)
            self._put(node)


def new_guid() -> str:
    """A global id: random, so hosts never need to agree on a counter."""
    return uuid.uuid4().hex[:20]
