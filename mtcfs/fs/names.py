"""The tree: names and what they lead to.

Lookups and the kernel's references to inodes, directories, symlinks, device
nodes, hard links, renames and removals (a name removed while a file is open
keeps the file until its last handle goes), directory handles, and the commit
rule for names: a rename that commits a step and a directory fsync return once
every live peer has applied them (`visibility`).
"""

from __future__ import annotations

import errno
import stat
from typing import Protocol

from mtcfs.core.events import Listener
from mtcfs.core.namespace import ROOT, Inode, Namespace
from mtcfs.core.steps import StepRules, dirs_under
from mtcfs.fs.errors import FsError
from mtcfs.fs.sealer import Sealer
from mtcfs.tiers.ram import RamTier

NAME_MAX = 255

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Visibility(Protocol):
    """What makes a change visible on the other hosts before a call returns."""

    async def wait_applied(self, what: str, node: Inode | None = None) -> list[str]:
        """Every live peer has applied what this host published so far (bounded);
        returns the peers that did not answer."""
        ...


class LocalOnly:
    """No peers: every change is visible everywhere at once."""

    async def wait_applied(self, what: str, node: Inode | None = None) -> list[str]:
        return []


class Names:
    """Its collaborators: the namespace and the RAM tier (a file's data goes with its
    last name and handle), `events` (what it tells the other parts: names made,
    renamed, removed), `sealer` (a regular file made by mknod is sealed empty; a
    commit seals what is `sealing` under it), `rules` (what commits a step) and
    `visibility` (the commit rule)."""

    def __init__(self, ns: Namespace, ram: RamTier, events: Listener, sealer: Sealer, *,
                 rules: StepRules, visibility: Visibility) -> None:
        self.ns = ns
        self.ram = ram
        self.events = events
        self.sealer = sealer
        self.rules = rules
        self.visibility = visibility
        self.dir_handles: dict[int, tuple[Inode, list[tuple[bytes, int]]]] = {}
        self._next_fh = 1

    # -- lookups ---------------------------------------------------------------

    def node(self, ino: int) -> Inode:
        node = self.ns.get(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> Inode:
        node = self.node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def lookup(self, parent_ino: int, name: bytes) -> Inode:
        parent = self._dir(parent_ino)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.node(parent.parent)
        else:
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            node = self.ns.child(parent, name)
            if node is None:
                raise FsError(errno.ENOENT)
        node.lookups += 1
        return node

    def forget(self, ino: int, n: int) -> None:
        node = self.ns.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - n)
        self.drop_if_unused(node)

    def remote_removed(self, node: Inode) -> None:
        """(Listener) A node removed or replaced by another host's change: stale from
        now on (see Inode.stale); freed once the kernel and handles let go."""
        node.stale = True
        self.drop_if_unused(node)

    def drop_if_unused(self, node: Inode) -> None:
        if node.linked or node.opens or node.ino == ROOT:
            return
        if node.is_file:
            self.ram.remove(node.ino)
            self.sealer.forget(node)
        if node.lookups == 0 and self.ns.get(node.ino) is node:
            self.ns.drop(node)
        elif node.is_file:
            # Keep the inode for the kernel's references, but not its record.
            self.ns.store.delete_inode(node.ino)

    # -- directories -----------------------------------------------------------

    def new(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
             target: bytes | None = None, rdev: int = 0) -> Inode:
        parent = self._dir(parent_ino)
        self._check_name(name)
        if name in parent.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        if stat.S_ISGID & parent.mode:
            gid = parent.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        node = self.ns.new_inode(parent, name, mode, uid, gid, target, rdev)
        node.lookups += 1
        if not node.is_file:
            self.events.changed([node])  # a file is announced at its seal
        return node

    def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self.new(parent_ino, name, stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)

    def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self.new(parent_ino, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, uid: int,
              gid: int) -> Inode:
        if stat.S_ISREG(mode):
            node = self.new(parent_ino, name, mode, uid, gid)
            self.ram.create(node.ino)
            self.sealer.seal_empty(node)
            return node
        if stat.S_IFMT(mode) in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            # Metadata only: the mount is nodev (device nodes cannot be opened as
            # devices) and FIFOs and sockets are local to a host's kernel.
            return self.new(parent_ino, name, mode, uid, gid, rdev=rdev)
        raise FsError(errno.EINVAL)

    def readlink(self, node: Inode) -> bytes:
        if not stat.S_ISLNK(node.mode) or node.target is None:
            raise FsError(errno.EINVAL)
        return node.target

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        node = self.ns.child(parent, name)
        if node is None:
            raise FsError(errno.ENOENT)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if node.children:
            raise FsError(errno.ENOTEMPTY)
        path = self.ns.path_of(node)
        self.ns.unlink(parent, name)
        self.events.removed(node, path)
        self.drop_if_unused(node)

    def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        node = self.ns.child(parent, name)
        if node is None:
            raise FsError(errno.ENOENT)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        path = self.ns.path_at(parent, name)
        was_own = (node.parent, node.name) == (parent.ino, name)
        self.ns.unlink(parent, name)
        self._name_gone(node, path, was_own)

    def _name_gone(self, node: Inode, path: str, was_own: bool) -> None:
        """A name of `node` was removed (unlink, or replaced by a rename): the file is
        gone, or, hard-linked, lost one of its names."""
        if node.linked:
            self.events.name_removed(node, path, was_own)
        else:
            self.events.removed(node, path)
        self.drop_if_unused(node)

    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: int) -> None:
        node = self._rename(old_parent_ino, old_name, new_parent_ino, new_name, flags)
        if node is not None and self.commits(node):
            # The commit of a step (a marker under its final name, or a step directory
            # renamed into place): every live peer has it when rename() returns.
            await self.sealer.settle(node)
            await self.wait_visible(node, "commit by rename of")

    def commits(self, node: Inode) -> bool:
        """Whether `node` under its current name completes a step: a commit marker in a
        committed step, or a directory that is (or holds) a committed step."""
        if not node.linked:
            return False
        if node.is_dir:
            return any(self.rules.is_committed_step(self.ns, d)
                       for d in (node, *dirs_under(self.ns, node)))
        return (self.rules.is_marker_name(node.name)
                and self.rules.is_committed_step(self.ns, self.ns.inodes[node.parent]))

    async def wait_visible(self, node: Inode, what: str) -> None:
        await self.visibility.wait_applied(
            f"{what} {self.ns.path_of(node) if node.linked else node.guid}", node)

    async def fsyncdir(self, node: Inode) -> None:
        """Every entry of the directory (and all this host published before) is
        applied on every live peer when the call returns."""
        for ino in list((node.children or {}).values()):
            child = self.ns.inodes.get(ino)
            if child is not None and not child.is_dir:
                await self.sealer.settle(child)
        await self.wait_visible(node, "fsync of directory")

    def _rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                new_name: bytes, flags: int) -> Inode | None:
        """The rename itself; returns the node moved (None when nothing moved)."""
        old_parent = self._dir(old_parent_ino)
        new_parent = self._dir(new_parent_ino)
        self._check_name(new_name)
        node = self.ns.child(old_parent, old_name)
        if node is None:
            raise FsError(errno.ENOENT)
        target = self.ns.child(new_parent, new_name)
        if flags & RENAME_EXCHANGE and flags & RENAME_NOREPLACE:
            raise FsError(errno.EINVAL)
        if node.is_dir and self.ns.is_ancestor(node, new_parent):
            raise FsError(errno.EINVAL)
        if flags & RENAME_EXCHANGE:
            if target is None:
                raise FsError(errno.ENOENT)
            if target.is_dir and self.ns.is_ancestor(target, old_parent):
                raise FsError(errno.EINVAL)
            if target is node:
                return None
            paths = (self.ns.path_of(node), self.ns.path_of(target))
            self.ns.rename(old_parent, old_name, new_parent, new_name, exchange=True)
            self.events.renamed(node, paths[0])
            self.events.renamed(target, paths[1])
            self.events.changed([node, target])  # one change: both names at once
            return node
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if target is node:
                return None
            if node.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if not node.is_dir and target.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir and target.children:
                raise FsError(errno.ENOTEMPTY)
        old_path = self.ns.path_of(node)
        target_own = target is not None and (target.parent, target.name) == (new_parent.ino,
                                                                              new_name)
        target_path = self.ns.path_at(new_parent, new_name)
        replaced = self.ns.rename(old_parent, old_name, new_parent, new_name)
        if replaced is not None:
            self._name_gone(replaced, target_path, target_own)
        self.events.renamed(node, old_path)
        self.events.changed([node])
        return node

    def link(self, node: Inode, new_parent_ino: int, new_name: bytes) -> Inode:
        """A hard link: one inode, one more name. The file keeps the path it is known
        by (its key on peers and in the bucket); the durable tier stores each further
        name as an object of its own (see Uploader.sync_links)."""
        parent = self._dir(new_parent_ino)
        self._check_name(new_name)
        if node.is_dir:
            raise FsError(errno.EPERM)
        if not node.linked or node.stale:
            raise FsError(errno.ENOENT)
        if new_name in (parent.children or {}):
            raise FsError(errno.EEXIST)
        self.ns.link(node, parent, new_name)
        node.lookups += 1
        self.events.linked(node)
        return node

    def opendir(self, node: Inode) -> int:
        """A directory handle holds a snapshot of the names, so a long listing
        is consistent and each readdir call continues where the last stopped."""
        if node.stale:
            raise FsError(errno.ESTALE)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        assert node.children is not None
        fh = self._next_fh
        self._next_fh += 1
        self.dir_handles[fh] = (node, sorted(node.children.items()))
        return fh

    def readdir(self, fh: int, start: int) -> list[tuple[int, bytes, Inode]]:
        """Entries from index `start` on, skipping those removed since opendir."""
        d, listing = self.dir_handle(fh)
        out = []
        for i in range(start, len(listing)):
            name, ino = listing[i]
            node = self.ns.get(ino)
            if node is not None and node.linked and (d.children or {}).get(name) == ino:
                out.append((i + 1, name, node))
        return out

    def dir_handle(self, fh: int) -> tuple[Inode, list[tuple[bytes, int]]]:
        h = self.dir_handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)
