"""The filesystem's semantics, independent of FUSE.

`Filesystem` implements what the POSIX calls mean over the namespace and the
RAM tier: permissions are checked by the kernel (`default_permissions`), so
this layer enforces structure (types, emptiness, names), space, and the file
lifecycle (open -> sealed with a crc32c). `mtcfs.fs.fuse_ops` adapts it to
pyfuse3.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from mtcfs.checksums import StreamingCrc, block_crcs_of_fd, format_crc
from mtcfs.events import Listener
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.namespace import CLOSED, INCOMPLETE, OPEN, ROOT, SEALING, Inode, Namespace
from mtcfs.fs.passthrough import Passthrough
from mtcfs.fs.writeclock import WriteClock
from mtcfs.persist.steps import StepRules, dirs_under
from mtcfs.tiers.ram import RamTier, RamTierFull

if TYPE_CHECKING:
    from mtcfs.fetch import Fetcher
    from mtcfs.lifecycle.copies import Copies
    from mtcfs.lifecycle.durability import Durability
    from mtcfs.lifecycle.space import SpaceManager

log = logging.getLogger(__name__)

NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
STATE_XATTR = b"user.mtcfs.state"
CONTROL_XATTR = b"user.mtcfs.control"
RESERVED_XATTR_PREFIX = b"user.mtcfs."

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

# The largest file mtcfs keeps (truncate or write beyond it: EFBIG). Per-block
# crc32cs of a file this size take 1 MiB, in the index and on every host.
MAX_FILE_SIZE = 1 << 40


SETID = stat.S_ISUID | stat.S_ISGID


def killed_privs(mode: int, in_group: bool = True) -> int:
    """`mode` without set-user-ID, and without set-group-ID if group-executable or if
    the caller is neither in the file's group nor privileged (as Linux since 6.2;
    set-group-ID without group-execute otherwise marks mandatory locking and stays)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP or not in_group:
        mode &= ~stat.S_ISGID
    return mode


class FsError(Exception):
    """A failed operation: the errno the caller sees."""

    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err


class NeedRoom(FsError):
    """write() found the RAM tier full: the caller may wait for room
    (`write_after_room`); to anyone else it is ENOSPC."""

    def __init__(self, need: int) -> None:
        super().__init__(errno.ENOSPC)
        self.need = need


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


@dataclass(eq=False)
class Handle:
    node: Inode
    fd: int
    writable: bool
    append: bool
    sync: bool = False  # opened with O_SYNC/O_DSYNC: the fsync level applies at close
    uid: int = 0  # the opener's: an unprivileged writer clears set-id bits
    in_group: bool = True  # the opener is in the file's group (or privileged)
    backing: int = 0  # its backing file id: reads and writes bypass the daemon


@dataclass
class Stats:
    bytes_written: int = 0
    bytes_read: int = 0
    seals: int = 0
    seal_full_passes: int = 0


class Filesystem(Listener):
    """The mount's semantics. Its collaborators: the namespace and the RAM tier it
    serves; `copies` (where copies are), `events` (what it tells the other parts:
    seals, renames, removals), `kernel` (the kernel's caches, for changes the
    kernel did not make), `clock` (when the trainer wrote), `fetcher` (data that is
    not in this RAM tier), `space` (room for writers), `durability` (fsync's
    level), `passthrough` (backing files), `visibility` (the commit rule).
    It listens for other hosts' removals (remote_removed)."""

    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                 kernel: KernelCache, clock: WriteClock, fetcher: Fetcher,
                 space: SpaceManager, durability: Durability, passthrough: Passthrough, *,
                 node_id: str, control_socket: str, rules: StepRules | None = None,
                 visibility: Visibility | None = None, visibility_mode: str = "fsync",
                 durable_name: str = "durable") -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.events = events
        self.kernel = kernel
        self.clock = clock
        self.fetcher = fetcher
        self.space = space
        self.durability = durability
        self.passthrough = passthrough
        self.node_id = node_id
        self.control_socket = control_socket
        self.rules = rules or StepRules()
        self.visibility: Visibility = visibility or LocalOnly()
        # "fsync": fsync, directory fsync and commits wait for the peers; "close": every
        # close of a written file too.
        self.visibility_mode = visibility_mode
        # The durable tier's name in `tiers` of user.mtcfs.state ("gcs", "file").
        self.durable_name = durable_name
        # A writer is opened with passthrough only while the RAM tier has this much
        # room (its writes cannot be made to wait); below it, writes pass the daemon,
        # which makes them wait for room as eviction frees it.
        self.write_headroom = min(1 << 30, max(16 << 20, ram.capacity // 8))
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, tuple[Inode, list[tuple[bytes, int]]]] = {}
        self._next_fh = 1
        self._crc: dict[int, StreamingCrc] = {}
        self._sealing: Counter[int] = Counter()  # inodes with a checksum pass in flight
        # Passthrough: the RAM file's (size, ctime) taken just before the checksum pass of
        # its last seal. tmpfs stamps ctime in fine grain once it was queried, so any write
        # after that stat changes it: an equal stamp means the sealed data is unchanged.
        self._seal_stamp: dict[int, tuple[int, int]] = {}
        self.stats = Stats()
        # True once any file carries security.capability: until then the
        # kernel's per-write capability probe is answered without a lookup.
        self.has_caps = any(b"security.capability" in n.xattrs for n in ns.inodes.values())

    @property
    def data_path(self) -> str:
        """"passthrough" once the kernel agreed to it (reads and writes of files in
        this RAM tier bypass the daemon), else "fuse"."""
        return "passthrough" if self.passthrough.enabled else "fuse"

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
        self._maybe_drop(node)

    def remote_removed(self, node: Inode) -> None:
        """(Listener) A node removed or replaced by another host's change: stale from
        now on (see Inode.stale); freed once the kernel and handles let go."""
        node.stale = True
        self._maybe_drop(node)

    def attributes_of(self, ino: int) -> Inode:
        """getattr: a stale node answers ESTALE unless a handle still has it open, so
        that the kernel's retry looks the name up afresh."""
        node = self.node(ino)
        if node.stale and not node.opens:
            raise FsError(errno.ESTALE)
        return node

    def refresh(self, node: Inode) -> None:
        """A file written through passthrough: its size and mtime are the RAM file's
        (the daemon does not see those writes)."""
        if not (node.pt_writers or node.pt_changed or node.state == SEALING):
            return
        try:
            st = self.ram.stat(node.ino)
        except FileNotFoundError:
            return
        node.size = st.st_size
        if st.st_mtime_ns != node.ram_mtime_ns:  # written since: (else kept, e.g. utimensat)
            node.ram_mtime_ns = st.st_mtime_ns
            node.mtime_ns = node.ctime_ns = st.st_mtime_ns
        self.ram.reconcile(node.ino)

    def _maybe_drop(self, node: Inode) -> None:
        if node.linked or node.opens or node.ino == ROOT:
            return
        if node.is_file:
            self.ram.remove(node.ino)
            self._crc.pop(node.ino, None)
            self._seal_stamp.pop(node.ino, None)
        if node.lookups == 0 and self.ns.get(node.ino) is node:
            self.ns.drop(node)
        elif node.is_file:
            # Keep the inode for the kernel's references, but not its record.
            self.ns.store.delete_inode(node.ino)

    # -- attributes ------------------------------------------------------------

    async def setattr(self, node: Inode, *, size: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, ctime_ns: int | None = None,
                caller_uid: int = 0, caller_in_group: bool = True) -> Inode:
        """`caller_in_group`: the caller is in the file's group, or privileged."""
        now = time.time_ns()
        # chown(f, -1, -1) reaches us as a setattr of nothing (ctime at most).
        nothing = all(x is None for x in (size, mode, uid, gid, atime_ns, mtime_ns))
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_file:
                raise FsError(errno.EINVAL)
            if size > MAX_FILE_SIZE:
                raise FsError(errno.EFBIG)
            if node.state == INCOMPLETE and size != 0:
                # Keeping part of an interrupted write would seal it as good.
                log.error("refusing to truncate %s to %d bytes: it is incomplete; "
                          "truncate it to 0, rewrite or remove it", self.ns.path_of(node), size)
                raise FsError(errno.EIO)
            if size != 0:
                await self.open_for_write(node)  # the kept part must be here first
            self._truncate(node, size)
            node.mtime_ns = now
            if node.writers == 0 and (node.dirty or node.state == SEALING or node.pt_changed):
                await self.seal(node)  # truncate(2) on a closed file: seal it again
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        # What Linux does to set-id bits (with HANDLE_KILLPRIV_V2 the kernel leaves it
        # to us): a chown of a non-directory clears them, whoever does it (set-group-ID
        # without group-execute stays for a caller in the group or privileged); a
        # truncate by an unprivileged caller too.
        chown = (uid is not None or gid is not None or nothing) and mode is None
        if not node.is_dir and (chown or (size is not None and caller_uid != 0)):
            node.mode = killed_privs(node.mode, caller_in_group or caller_uid == 0)
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        node.ctime_ns = ctime_ns if ctime_ns is not None else now
        # Size and times of a file being written are written at seal time.
        if node.state != OPEN or size is not None or mode is not None or uid is not None:
            with self.ns.store.transaction():
                self.ns.persist(node)
        if node.state != OPEN:
            self.events.changed([node])
        return node

    def _truncate(self, node: Inode, size: int) -> None:
        if size == 0 and not node.has_data:
            # Only in the durable tier and emptied: nothing to fetch. A new RAM
            # file, so that a fetch already in flight cannot write into it.
            self.ram.replace(node.ino)
            self.copies.emptied(node)
        if size == node.size:
            return
        self._mark_dirty(node)
        fd = self.ram.fd(node.ino)
        tmp = fd is None
        if tmp:
            fd = self.ram.acquire(node.ino)
        try:
            self.ram.truncate(node.ino, fd, size, node.size)
        except OSError as e:
            raise FsError(e.errno or errno.EIO) from None
        finally:
            if tmp:
                self.ram.release(node.ino)
        node.size = size
        node.wseq += 1
        self._crc_for(node).truncate(size)

    # -- directories -----------------------------------------------------------

    def _new(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
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
        return self._new(parent_ino, name, stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)

    def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self._new(parent_ino, name, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, uid: int,
              gid: int) -> Inode:
        if stat.S_ISREG(mode):
            node = self._new(parent_ino, name, mode, uid, gid)
            self.ram.create(node.ino)
            self._seal_now(node, crc=0)
            return node
        if stat.S_IFMT(mode) in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            # Metadata only: the mount is nodev (device nodes cannot be opened as
            # devices) and FIFOs and sockets are local to a host's kernel.
            return self._new(parent_ino, name, mode, uid, gid, rdev=rdev)
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
        self._maybe_drop(node)

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
        self._maybe_drop(node)

    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: int) -> None:
        node = self._rename(old_parent_ino, old_name, new_parent_ino, new_name, flags)
        if node is not None and self.commits(node):
            # The commit of a step (a marker under its final name, or a step directory
            # renamed into place): every live peer has it when rename() returns.
            await self._settle(node)
            await self._visible(node, "commit by rename of")

    async def _settle(self, node: Inode) -> None:
        """Seal now what is `sealing` at or below `node` (closed through passthrough,
        its checksum not taken yet): a commit or a directory fsync covers it."""
        if node.is_dir:
            files = [self.ns.inodes[i] for i in (node.children or {}).values()]
            files += [f for d in dirs_under(self.ns, node) for f in
                      (self.ns.inodes[i] for i in (d.children or {}).values())]
        else:
            files = [node]
        for f in files:
            if f.is_file and f.state == SEALING and not f.writers:
                await self.seal(f)

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

    async def _visible(self, node: Inode, what: str) -> None:
        await self.visibility.wait_applied(
            f"{what} {self.ns.path_of(node) if node.linked else node.guid}", node)

    async def fsyncdir(self, node: Inode) -> None:
        """Every entry of the directory (and all this host published before) is
        applied on every live peer when the call returns."""
        for ino in list((node.children or {}).values()):
            child = self.ns.inodes.get(ino)
            if child is not None and not child.is_dir:
                await self._settle(child)
        await self._visible(node, "fsync of directory")

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

    # -- files -----------------------------------------------------------------

    def create(self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int) -> tuple[int, Inode]:
        node = self._new(parent_ino, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        self.ram.create(node.ino)
        node.dirty = True
        self._crc[node.ino] = StreamingCrc()
        return self._open_handle(node, flags, uid), node

    async def open(self, node: Inode, flags: int, uid: int = 0, in_group: bool = True) -> int:
        """`uid`, `in_group`: the opener, and whether it is in the file's group."""
        if node.stale:
            raise FsError(errno.ESTALE)  # the kernel retries with a fresh lookup
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_file:
            raise FsError(errno.EINVAL)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable and node.state == SEALING:
            # Its last writer closed it (through passthrough) and its checksum is not
            # taken yet (the release may still be on its way): what it wrote is a
            # version of its own, sealed before this writer may change it.
            await self.seal(node)
        if flags & os.O_TRUNC and writable:
            self._truncate(node, 0)
            if uid != 0 and node.mode & SETID:
                self._kill_privs(node, in_group)  # even when there was nothing to cut
        elif node.state == INCOMPLETE:
            log.error("refusing to open %s: it is incomplete (its writer never closed it); "
                      "rewrite or remove it", self.ns.path_of(node))
            raise FsError(errno.EIO)
        elif not node.has_data:
            # Start fetching now; reads wait for the ranges they need.
            self.fetcher.start(node)
        fh = self._open_handle(node, flags, uid, in_group)
        if writable and not node.has_data:
            try:
                await self.open_for_write(node)
            except FsError:
                await self.release(fh)
                raise
        return fh

    def _open_handle(self, node: Inode, flags: int, uid: int = 0, in_group: bool = True) -> int:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        node.last_access = time.monotonic()
        fd = self.ram.acquire(node.ino)
        fh = self._next_fh
        self._next_fh += 1
        h = self.handles[fh] = Handle(node, fd, writable, bool(flags & os.O_APPEND),
                                      bool(flags & (os.O_SYNC | os.O_DSYNC)), uid,
                                      in_group)
        node.opens += 1
        if writable:
            node.writers += 1
        h.backing = self.passthrough.open(node.ino, fd, self._passthrough_allowed(node, writable))
        if h.backing and writable:
            # Its writes will not pass the daemon. Its sealed version stays what others
            # read, replicate and upload (every copy is checked against its checksum, so
            # changed bytes are refused, never passed on); it is recorded as open (a
            # crash leaves it incomplete unless its data is still that version), and it
            # is checksummed from its RAM file when the last writer is gone.
            node.pt_writers += 1
            node.pt_changed = True
            self.clock.passthrough_opened(node.ino)
            self._crc[node.ino] = StreamingCrc(valid=False)
            node.wseq += 1
            with self.ns.store.transaction():
                self.ns.persist(node)
        return fh

    def _passthrough_allowed(self, node: Inode, writable: bool) -> bool:
        """May the first open of `node` pass through (see mtcfs.fs.passthrough)?"""
        if not node.has_data or node.state == INCOMPLETE:
            return False  # being fetched, or never served: the daemon serves it
        if self.fetcher.busy(node):
            return False
        if writable:
            if node.mode & SETID:
                return False  # its first write clears them: that write must reach us
            if self.ram.free < self.write_headroom:
                return False  # through the daemon, a writer can wait for room
        return True

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handle(fh)
        if h.node.state == INCOMPLETE:
            raise FsError(errno.EIO)
        if not h.node.has_data:
            # Verified bytes or EIO, never a short read (the kernel would cache
            # zeros) nor bytes of a fetch that failed or was replaced meanwhile.
            data = await self._fetched(h.node, h.fd, off, size)
        else:
            data = os.pread(h.fd, size, off)
        self.stats.bytes_read += len(data)
        return data

    def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self.handle(fh)
        node = h.node
        if not node.dirty:
            self._mark_dirty(node)
        if h.append:
            off = node.size
        if off + len(buf) > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG)
        if node.mode & SETID and h.uid != 0:
            self._kill_privs(node, h.in_group)
        try:
            n = self.ram.write(node.ino, h.fd, off, buf, node.size)
        except RamTierFull as e:
            raise NeedRoom(e.need) from None
        except OSError as e:
            raise FsError(e.errno or errno.EIO) from None
        end = off + n
        node.wseq += 1
        if end > node.size:
            node.size = end
        crc = self._crc.get(node.ino)
        if crc is not None:
            crc.update(off, buf if n == len(buf) else buf[:n])
        node.mtime_ns = node.ctime_ns = time.time_ns()
        self.stats.bytes_written += n
        self.clock.wrote()
        return n

    async def write_after_room(self, fh: int, off: int, buf: bytes, need: int) -> int:
        """A write that found the RAM tier full: evict, or wait (bounded) for data
        to become evictable, then write; ENOSPC if no room came (the lifecycle
        logs why)."""
        h = self.handle(fh)
        while True:
            try:
                await self.space.make_room(need, self.ns.path_of(h.node))
            except OSError:
                self.ram.enospc_count += 1
                raise FsError(errno.ENOSPC) from None
            try:
                return self.write(fh, off, buf)
            except NeedRoom as e:  # someone else took the room meanwhile
                need = e.need

    async def _fetched(self, node: Inode, fd: int, off: int, size: int) -> bytes:
        """[off, off+size) of a file being read through, once verified."""
        try:
            return await self.fetcher.read(node, fd, off, size)
        except OSError as e:
            log.error("cannot read %s: %s", self.ns.path_of(node), e.strerror)
            raise FsError(errno.EIO) from None

    async def open_for_write(self, node: Inode) -> None:
        """A writer of a file that is only in the durable tier needs all of it first."""
        if not node.has_data:
            try:
                await self.fetcher.wait_complete(node)
            except OSError:
                raise FsError(errno.EIO) from None

    def _kill_privs(self, node: Inode, in_group: bool = True) -> None:
        """A write by an unprivileged opener clears the set-id bits (as Linux does)."""
        mode = killed_privs(node.mode, in_group)
        if mode != node.mode:
            node.mode = mode
            node.ctime_ns = time.time_ns()
            with self.ns.store.transaction():
                self.ns.persist(node)
            self.kernel.attrs(node.ino)

    def _crc_for(self, node: Inode) -> StreamingCrc:
        crc = self._crc.get(node.ino)
        if crc is None:
            # The sealed checksum resumes only if it still describes the data: not once
            # a passthrough writer may have changed it unseen.
            resumable = (node.crc32c is not None and not node.pt_changed
                         and node.state != SEALING and node.size == node.sealed_size)
            crc = self._crc[node.ino] = (
                StreamingCrc(node.crc32c, node.size, blocks=node.block_crcs)
                if resumable
                else StreamingCrc(valid=False)
            )
        return crc

    def _mark_dirty(self, node: Inode) -> None:
        """First change to a sealed file: record it as open, so that a crash
        from here on leaves it marked incomplete rather than silently changed."""
        if node.dirty:
            return
        self._crc_for(node)
        node.dirty = True
        self.events.rewriting(node)
        if node.state != OPEN:
            node.state = OPEN
            with self.ns.store.transaction():
                self.ns.persist(node)

    async def flush(self, fh: int) -> None:
        """close(): the kernel has written back this file's dirty pages. Seal
        now if this is the last writer, so close() returns only once the
        file's state and crc32c are recorded; then, for a file that was fsynced,
        a commit marker, a file under a temporary name (a step being written), or
        every file with --visibility close, wait until every live peer has the seal.

        A file written through passthrough is sealed when its last handle is
        released (a shared writable mapping may outlive close()): close() marks it
        `sealing` and returns at once, unless it must be visible now."""
        h = self.handle(fh)
        node = h.node
        if not h.writable:
            return
        # Also every file of a step being written (under a temporary name, e.g. Orbax's
        # *.orbax-checkpoint-tmp): checkpointers read each other's files there right
        # after a barrier, some written without fsync (Orbax's array_metadatas).
        visible = (node.fsynced or h.sync or self.visibility_mode == "close"
                   or self.commits(node) or self.rules.is_temporary(self.ns, node))
        # With passthrough the daemon does not see writes: a file a passthrough writer
        # had open counts as written (its checksum tells whether it changed).
        if h.backing:
            # A passthrough writer that ran into the limit got ENOSPC from the kernel, not
            # from us: its close is where the daemon can notice.
            self.space.check_full()
        # Fsynced, then closed without a write since: that seal stands (the release,
        # after any mapping is gone, checksums it once more, off the close() path).
        unchanged = h.backing and not node.dirty and self._unchanged_since_seal(node)
        if node.writers <= 1 and not unchanged and (node.dirty or (h.backing and node.pt_changed)):
            if h.backing and not visible:
                self.refresh(node)
                if node.state != SEALING:
                    node.state = SEALING
                    with self.ns.store.transaction():
                        self.ns.persist(node)
            else:
                await self.seal(node)
        if visible and not node.dirty:
            await self._visible(node, "close of")
        if h.sync and not node.dirty:
            await self._durable(node)

    def _unchanged_since_seal(self, node: Inode) -> bool:
        stamp = self._seal_stamp.get(node.ino)
        if stamp is None or node.state != CLOSED:
            return False
        try:
            st = self.ram.stat(node.ino)
        except FileNotFoundError:
            return False
        return (st.st_size, st.st_ctime_ns) == stamp

    async def fsync(self, fh: int) -> None:
        """fsync(): seal what was written so far as a version, and return once every
        live peer has it (whatever the level); then wait for the --fsync level."""
        h = self.handle(fh)
        node = h.node
        if h.sync:
            # O_SYNC: the kernel sends an fsync after every write(); visibility and
            # the level are paid once, at close (flush above).
            if node.dirty:
                with self.ns.store.transaction():
                    self.ns.persist(node)
            return
        if h.backing:
            await trio.to_thread.run_sync(os.fsync, h.fd)  # no-op on tmpfs, but honest
        if node.dirty or node.state == SEALING:
            await self.seal(node)  # a version others can see: what was written so far
            if node.dirty:
                return  # written during the seal's pass: the next fsync/close seals it
        node.fsynced = True
        await self._visible(node, "fsync of")
        if self.durability.level != "local":
            await self._durable(node)

    async def _durable(self, node: Inode) -> None:
        try:
            await self.durability.wait(node)
        except OSError:
            raise FsError(errno.EIO) from None

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        node = h.node
        node.opens -= 1
        self.passthrough.release(node.ino, h.backing)
        if h.writable:
            node.writers -= 1
            if h.backing:
                node.pt_writers -= 1
                self.clock.passthrough_released(node.ino, node.pt_writers)
            if node.writers == 0 and (node.dirty or node.state == SEALING or node.pt_changed):
                # The last writer is gone (with it any mapping): the final checksum.
                await self.seal(node)
                # Still "written through passthrough" while anyone writes: a writer that
                # opened during the seal's pass (the seal then left it to the last
                # release) must find it so, or its close would seal nothing.
                node.pt_changed = node.pt_changed and node.writers > 0
        self.ram.release(node.ino)
        if node.opens == 0 and node.ino not in self._sealing:
            self._crc.pop(node.ino, None)  # (a seal's pass in flight keeps its stream)
            self._seal_stamp.pop(node.ino, None)
            node.fsynced = False
        self._maybe_drop(node)

    async def seal(self, node: Inode) -> None:
        if not node.linked:
            node.dirty = False
            return
        stamp = None
        if node.pt_changed:
            self.refresh(node)  # written through passthrough: the RAM file says how big
            self._crc[node.ino] = StreamingCrc(valid=False)
            try:
                st = self.ram.stat(node.ino)  # before the pass: a later write changes it
                stamp = (st.st_size, st.st_ctime_ns)
            except FileNotFoundError:
                pass
        stream = self._crc_for(node)
        crc, blocks = stream.result(node.size), stream.blocks(node.size)
        while crc is None or blocks is None:
            # Written out of order: one pass over the data, off the event loop.
            seq, size = node.wseq, node.size
            self.stats.seal_full_passes += 1
            fd = self.ram.acquire(node.ino)
            self._sealing[node.ino] += 1
            try:
                crc, blocks = await trio.to_thread.run_sync(block_crcs_of_fd, fd, size)
            finally:
                self._sealing[node.ino] -= 1
                if not self._sealing[node.ino]:
                    del self._sealing[node.ino]
                self.ram.release(node.ino)
            if not node.linked:
                return
            if node.wseq != seq or node.size != size:
                if node.writers:
                    return  # written during the pass: the last release seals again
                # Truncated (or written and closed) during the pass, nobody writing
                # now: no release will come to seal it, so take it again.
                stream = self._crc_for(node)
                crc, blocks = stream.result(node.size), stream.blocks(node.size)
                if crc is None or blocks is None:
                    continue
                break
            self._crc[node.ino] = StreamingCrc(crc, node.size, blocks=blocks)
        self._seal_now(node, crc, blocks)
        if stamp is not None and stamp[0] == node.size:
            self._seal_stamp[node.ino] = stamp
        else:
            self._seal_stamp.pop(node.ino, None)

    def _seal_now(self, node: Inode, crc: int, blocks: bytes | None = b"") -> None:
        # Opened for writing but unchanged (e.g. a read-write open that only read): the
        # same version, its copies and persisted object still good.
        same = (node.version > 0 and node.crc32c == crc and node.block_crcs == blocks
                and node.size == node.sealed_size and node.state != INCOMPLETE
                and not node.cached and node.author == self.node_id)
        node.crc32c = crc
        node.block_crcs = blocks
        node.state = CLOSED
        node.dirty = False
        node.sealed_size = node.size
        if not same:
            node.version += 1
            self.copies.sealed_here(node)
        self.ram.reconcile(node.ino)
        with self.ns.store.transaction():
            self.ns.persist(node)
        self.stats.seals += 1
        if same:
            self.events.resealed(node)
        else:
            self.events.sealed(node)

    # -- extended attributes -----------------------------------------------------

    def state_of(self, node: Inode) -> dict[str, object]:
        self.refresh(node)
        if node.is_dir:
            return {"type": "directory", "path": self.ns.path_of(node)}
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
            "lifecycle": self._lifecycle_state(node, here),
        }

    def _lifecycle_state(self, node: Inode, here: bool) -> str:
        """Where the file is in its lifecycle (docs/semantics.md), as seen from this host:
        open, incomplete, closed, replicated (K peer copies), persisted, evictable
        (this host's copy may go), evicted (written here, metadata only here now),
        remote (another host's file, not in this host's RAM)."""
        if node.state != CLOSED:
            return node.state
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

    def getxattr(self, node: Inode, name: bytes) -> bytes:
        if name == STATE_XATTR:
            return json.dumps(self.state_of(node)).encode()
        if name == CONTROL_XATTR and node.ino == ROOT:
            return self.control_socket.encode()
        try:
            return node.xattrs[name]
        except KeyError:
            raise FsError(errno.ENODATA) from None

    def setxattr(self, node: Inode, name: bytes, value: bytes) -> None:
        if name.startswith(RESERVED_XATTR_PREFIX):
            raise FsError(errno.EPERM)
        if not name.startswith((b"user.", b"trusted.", b"security.")):
            raise FsError(errno.EOPNOTSUPP)
        if len(name) > XATTR_NAME_MAX:
            raise FsError(errno.ERANGE)
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG)
        if name == b"security.capability":
            self.has_caps = True
        self.ns.set_xattr(node, name, value)

    def listxattr(self, node: Inode) -> list[bytes]:
        # user.mtcfs.* are virtual and not listed, so `cp -a` and rsync -X
        # do not try to copy them.
        return list(node.xattrs)

    def removexattr(self, node: Inode, name: bytes) -> None:
        if name.startswith(RESERVED_XATTR_PREFIX):
            raise FsError(errno.EPERM)
        if name not in node.xattrs:
            raise FsError(errno.ENODATA)
        self.ns.remove_xattr(node, name)

    # -- status ------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        files = self.ns.files()
        states: dict[str, int] = {}
        for f in files:
            states[f.state] = states.get(f.state, 0) + 1
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
            "open_handles": len(self.handles),
            "bytes_written": self.stats.bytes_written,
            "bytes_read": self.stats.bytes_read,
            "seals": self.stats.seals,
            "seal_full_passes": self.stats.seal_full_passes,
        }
