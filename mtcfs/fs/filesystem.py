"""The filesystem's semantics, independent of FUSE.

`Filesystem` implements what the POSIX calls on files mean over the namespace and
the RAM tier: permissions are checked by the kernel (`default_permissions`), so
this layer enforces types, sizes, space and set-id rules, and keeps the open
files' handles. Its parts: `Names` (mtcfs.fs.names: the tree's operations),
`Sealer` (mtcfs.fs.sealer: open -> sealed with a crc32c), `Xattrs`
(mtcfs.fs.xattrs); `FileStateView` (mtcfs.fs.state_view) shows its files'
state. `mtcfs.fs.fuse_ops` adapts them to pyfuse3.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, INCOMPLETE, OPEN, Inode, Namespace
from mtcfs.core.steps import StepRules, files_under
from mtcfs.fs.errors import FsError as FsError
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.names import RENAME_EXCHANGE as RENAME_EXCHANGE
from mtcfs.fs.names import RENAME_NOREPLACE as RENAME_NOREPLACE
from mtcfs.fs.names import LocalOnly as LocalOnly
from mtcfs.fs.names import Names
from mtcfs.fs.passthrough import Passthrough
from mtcfs.fs.sealer import Sealer
from mtcfs.fs.writeclock import WriteClock
from mtcfs.fs.xattrs import Xattrs
from mtcfs.tiers.ram import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, RamTier, RamTierFull

if TYPE_CHECKING:
    from mtcfs.core.copies import Copies
    from mtcfs.fetch import Fetcher

log = logging.getLogger(__name__)


class SpaceManager(Protocol):
    """What writes ask of the RAM tier's space (mtcfs.lifecycle.space has it)."""

    async def make_room(self, need: int, what: str) -> None: ...
    def check_full(self) -> None: ...
    def busy(self, node: Inode) -> bool: ...


class Durability(Protocol):
    """fsync's level (mtcfs.lifecycle.durability has it)."""

    level: str

    async def wait(self, node: Inode) -> None: ...


SETID = stat.S_ISUID | stat.S_ISGID

# The fallocate(2) modes tmpfs has: allocate (and extend), allocate past the end, punch
# a hole. Any other mode is EOPNOTSUPP, as tmpfs answers.
FALLOCATE_MODES = (0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)


def ALL_GROUPS(gid: int) -> bool:  # noqa: N802  (a constant: the privileged opener's)
    """The group membership of a privileged (or unknown) caller: every group."""
    return True


def killed_privs(mode: int, in_group: bool = True) -> int:
    """`mode` without set-user-ID, and without set-group-ID if group-executable or if
    the caller is neither in the file's group nor privileged (as Linux since 6.2;
    set-group-ID without group-execute otherwise marks mandatory locking and stays)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP or not in_group:
        mode &= ~stat.S_ISGID
    return mode


class NeedRoom(FsError):
    """write() found the RAM tier full: the caller may wait for room
    (`write_after_room`); to anyone else it is ENOSPC."""

    def __init__(self, need: int) -> None:
        super().__init__(errno.ENOSPC)
        self.need = need


@dataclass(eq=False)
class Handle:
    node: Inode
    fd: int
    writable: bool
    append: bool
    sync: bool = False  # opened with O_SYNC/O_DSYNC: the fsync level applies at close
    uid: int = 0  # the opener's: an unprivileged writer clears set-id bits
    # Is the opener in group `gid`? Asked at each write or fallocate that may clear
    # set-id bits, of the file's group then: root may chown the file after the open.
    member_of: Callable[[int], bool] = ALL_GROUPS
    backing: int = 0  # its backing file id: reads and writes bypass the daemon


@dataclass
class Stats:
    bytes_written: int = 0  # through the daemon (see SealStats for passthrough)
    bytes_read: int = 0


class Filesystem(Listener):
    """The mount's semantics. Its collaborators: the namespace and the RAM tier it
    serves; `copies` (where copies are), `events` (what it tells the other parts:
    attribute changes), `kernel` (the kernel's caches, for changes the
    kernel did not make), `clock` (when the trainer wrote), `fetcher` (data that is
    not in this RAM tier), `space` (room for writers), `durability` (fsync's
    level), `passthrough` (backing files), `sealer` (checksums and seals), `names`
    (the tree: lookups, directories, links, renames, removals, the commit rule),
    `xattrs` (extended attributes; user.mtcfs.state is FileStateView's).
    It listens for other hosts' removals (remote_removed)."""

    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                 kernel: KernelCache, clock: WriteClock, fetcher: Fetcher,
                 space: SpaceManager, durability: Durability, passthrough: Passthrough,
                 sealer: Sealer, names: Names, xattrs: Xattrs, *, node_id: str,
                 rules: StepRules, visibility_mode: str = "fsync",
                 kernel_times: bool = False, open_wait: float = 0.0) -> None:
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
        self.sealer = sealer
        self.names = names
        self.xattrs = xattrs
        self.node_id = node_id
        self.rules = rules
        # "fsync": fsync, directory fsync and commits wait for the peers; "close": every
        # close of a written file too.
        self.visibility_mode = visibility_mode
        # With the writeback cache the kernel keeps a written file's mtime and ctime
        # and sends them (setattr) before the file's flush: a write arriving later
        # must not put the daemon's clock in their place (a crash would then show
        # another mtime than the trainer saw).
        self.kernel_times = kernel_times
        # How long a reader's open waits for a file from a peer to arrive whole (then
        # read through passthrough) before it reads it as it arrives, via the daemon.
        self.open_wait = open_wait
        # A writer is opened with passthrough only while the RAM tier has this much
        # room (its writes cannot be made to wait); below it, writes pass the daemon,
        # which makes them wait for room as eviction frees it.
        self.write_headroom = min(1 << 30, max(16 << 20, ram.capacity // 8))
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.stats = Stats()

    @property
    def data_path(self) -> str:
        """"passthrough" once the kernel agreed to it (reads and writes of files in
        this RAM tier bypass the daemon), else "fuse"."""
        return "passthrough" if self.passthrough.enabled else "fuse"

    # -- lookups ---------------------------------------------------------------

    def node(self, ino: int) -> Inode:
        return self.names.node(ino)

    def remote_removed(self, node: Inode) -> None:
        self.names.remote_removed(node)  # (Listener)

    # Names the lifecycle removes and renames (retention, withdrawal).

    def unlink(self, parent_ino: int, name: bytes) -> None:
        self.names.unlink(parent_ino, name)

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        self.names.rmdir(parent_ino, name)

    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: int) -> None:
        await self.names.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags)

    def attributes_of(self, ino: int) -> Inode:
        """getattr: a stale node answers ESTALE unless a handle still has it open, so
        that the kernel's retry looks the name up afresh."""
        node = self.node(ino)
        if node.stale and not node.opens:
            raise FsError(errno.ESTALE)
        return node

    # -- attributes ------------------------------------------------------------

    async def setattr(self, node: Inode, *, size: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, ctime_ns: int | None = None,
                caller_uid: int = 0, caller_in_group: bool = True) -> Inode:
        """`caller_in_group`: the caller is in the file's group, or privileged."""
        now = time.time_ns()
        # chown(f, -1, -1) reaches us as a setattr of nothing (ctime at most).
        nothing = all(x is None for x in (size, mode, uid, gid, atime_ns, mtime_ns))
        if (nothing and (ctime_ns is not None or not node.is_file) and not node.is_dir
                and caller_uid != 0 and caller_uid != node.uid
                and killed_privs(node.mode, caller_in_group) != node.mode):
            # chown(f, -1, -1) by another user of a file whose set-id bits it would clear:
            # Linux refuses it (clearing them is a mode change). The kernel's own clearing
            # of the bits, on a write or fallocate of a regular file, comes without a
            # ctime; so does any setattr of a device node, FIFO or socket (the kernel
            # sends ctime for regular files only), which nothing but chown makes empty.
            raise FsError(errno.EPERM)
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_file:
                raise FsError(errno.EINVAL)
            if node.state == INCOMPLETE and size != 0:
                # Keeping part of an interrupted write would seal it as good.
                log.error("refusing to truncate %s to %d bytes: it is incomplete; "
                          "truncate it to 0, rewrite or remove it", self.ns.path_of(node), size)
                raise FsError(errno.EIO)
            if size != 0:
                await self.open_for_write(node)  # the kept part must be here first
            async with self.sealer.shrinking(node):
                self._truncate(node, size)
            node.mtime_ns = now
            await self.sealer.resealed_closed(node)  # truncate(2) of a closed file
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
        self.sealer.writing(node)
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
        self.sealer.truncated(node, size)

    # -- files -----------------------------------------------------------------

    def create(self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int) -> tuple[int, Inode]:
        node = self.names.new(parent_ino, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
        self.ram.create(node.ino)
        self.sealer.created(node)
        return self._open_handle(node, flags, uid), node

    async def open(self, node: Inode, flags: int, uid: int = 0,
                   member_of: Callable[[int], bool] = ALL_GROUPS) -> int:
        """`uid`: the opener; `member_of(gid)`: whether it is in that group (or
        privileged)."""
        if node.stale:
            raise FsError(errno.ESTALE)  # the kernel retries with a fresh lookup
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_file:
            raise FsError(errno.EINVAL)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            await self.sealer.before_writer(node)
        if flags & os.O_TRUNC and writable:
            async with self.sealer.shrinking(node):
                self._truncate(node, 0)
            if uid != 0 and node.mode & SETID:
                # (even when there was nothing to cut)
                self._kill_privs(node, member_of(node.gid))
        elif node.state == INCOMPLETE:
            log.error("refusing to open %s: it is incomplete (its writer never closed it); "
                      "rewrite or remove it", self.ns.path_of(node))
            raise FsError(errno.EIO)
        elif not node.has_data:
            wait = None if writable else self.fetcher.open_wait(node)
            if wait is not None:
                # Being fetched whole ahead of readers (a replacement's restore, a
                # prefetch, a step's read-ahead): wait for it, then read it in RAM
                # through passthrough, not read by read through the daemon as it arrives.
                with trio.move_on_after(wait), contextlib.suppress(OSError):
                    await self.fetcher.wait_complete(node)  # (else: the reads say why)
            if not node.has_data:
                # Start fetching now; reads wait for the ranges they need.
                self.fetcher.start(node)
                step = self.rules.enclosing_step(self.ns, node)
                if step is not None:  # a load reads the step's other files next
                    self.fetcher.step_ahead(list(files_under(self.ns, step)))
                if not writable and self._waits_whole(node):
                    # The same for any file a peer holds, for up to --open-wait (the
                    # daemon's replies to each read and the fetch share the cores).
                    with trio.move_on_after(self.open_wait), contextlib.suppress(OSError):
                        await self.fetcher.wait_complete(node)
        fh = self._open_handle(node, flags, uid, member_of)
        if writable and not node.has_data:
            try:
                await self.open_for_write(node)
            except FsError:
                await self.release(fh)
                raise
        return fh

    def _waits_whole(self, node: Inode) -> bool:
        """A reader's open of `node`, not here, waits for it whole (--open-wait, with
        passthrough): not one being written elsewhere (read from its writer), nor one
        only in the bucket (read as it comes)."""
        return (bool(self.open_wait) and self.passthrough.enabled and node.size > 0
                and node.state == CLOSED and bool(self.copies.elsewhere(node)))

    def _open_handle(self, node: Inode, flags: int, uid: int = 0,
                     member_of: Callable[[int], bool] = ALL_GROUPS) -> int:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        node.last_access = time.monotonic()
        fd = self.ram.acquire(node.ino)
        fh = self._next_fh
        self._next_fh += 1
        h = self.handles[fh] = Handle(node, fd, writable, bool(flags & os.O_APPEND),
                                      bool(flags & (os.O_SYNC | os.O_DSYNC)), uid,
                                      member_of)
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
            self.sealer.unstreamed(node)
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
        self.sealer.writing(node)
        if h.append:
            off = node.size
        if node.mode & SETID and h.uid != 0:
            self._kill_privs(node, h.member_of(node.gid))
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
        self.sealer.wrote(node, off, buf if n == len(buf) else buf[:n])
        if not self.kernel_times:
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

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """fallocate(2) as tmpfs has it: allocate [off, off+length) (mode 0 also extends
        the file), allocate past the end (KEEP_SIZE), or punch a hole (zeros). Room is
        made as for a write (waiting up to --full-timeout, then ENOSPC). A change of
        the data or the size makes the file dirty, as a write does: a new version at
        its seal, checksummed afresh where the streamed crc no longer covers it."""
        h = self.handle(fh)
        node = h.node
        if mode not in FALLOCATE_MODES:
            raise FsError(errno.EOPNOTSUPP)
        if not h.writable:
            raise FsError(errno.EBADF)
        if off < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        end = off + length
        self.sealer.refresh(node)  # written through passthrough: the RAM file's size
        grows = not mode & FALLOC_FL_KEEP_SIZE and end > node.size
        await self.open_for_write(node)
        punch = bool(mode & FALLOC_FL_PUNCH_HOLE)
        need = 0 if punch else await self._room_to_allocate(h, off, end)
        changes_data = grows or (punch and off < node.size)
        if changes_data:
            self.sealer.writing(node)  # first: a crash from here leaves it incomplete
        try:
            async with self.sealer.shrinking(node) if punch else contextlib.nullcontext():
                await self.ram.fallocate(node.ino, h.fd, mode, off, length, reserve=need)
        except OSError as e:
            raise FsError(e.errno or errno.EIO) from None
        if node.mode & SETID and h.uid != 0:
            self._kill_privs(node, h.member_of(node.gid))
        node.mtime_ns = node.ctime_ns = time.time_ns()
        if not changes_data:
            # Allocated only: the data is the same (a sealed file keeps its version).
            if node.state != OPEN:
                with self.ns.store.transaction():
                    self.ns.persist(node)
                self.events.changed([node])
            return
        if grows:
            node.size = max(node.size, end)  # zeros from the old end: past the stream
        if punch:
            self.sealer.punched(node, off)
        node.wseq += 1
        self.clock.wrote()

    async def _room_to_allocate(self, h: Handle, off: int, end: int) -> int:
        """Room for allocating [off, end) of the file (see write_after_room); returns
        how much it may take."""
        while True:
            try:
                return self.ram.room_to_allocate(h.fd, off, end)
            except RamTierFull as e:
                need = e.need
            try:
                await self.space.make_room(need, self.ns.path_of(h.node))
            except OSError:
                self.ram.enospc_count += 1
                raise FsError(errno.ENOSPC) from None

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

    async def flush(self, fh: int) -> None:
        """close(): the kernel has written back this file's dirty pages. The last
        writer's close seals it (see Sealer.closed); then, for a file that was
        fsynced, a commit marker, a file under a temporary name (a step being
        written), or every file with --visibility close, wait until every live peer
        has the seal."""
        h = self.handle(fh)
        node = h.node
        if not h.writable:
            return
        # Also every file of a step being written (under a temporary name, e.g. Orbax's
        # *.orbax-checkpoint-tmp): checkpointers read each other's files there right
        # after a barrier, some written without fsync (Orbax's array_metadatas).
        visible = (node.fsynced or h.sync or self.visibility_mode == "close"
                   or self.names.commits(node) or self.rules.is_temporary(self.ns, node))
        if h.backing:
            # A passthrough writer that ran into the limit got ENOSPC from the kernel, not
            # from us: its close is where the daemon can notice.
            self.space.check_full()
        await self.sealer.closed(node, bool(h.backing), visible)
        if visible and not node.dirty:
            await self.names.wait_visible(node, "close of")
        if h.sync and not node.dirty:
            await self._durable(node)

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
        if not await self.sealer.fsynced(node):
            return  # written during the seal's pass: the next fsync/close seals it
        node.fsynced = True
        await self.names.wait_visible(node, "fsync of")
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
            await self.sealer.last_writer_gone(node)
        self.ram.release(node.ino)
        self.sealer.handle_gone(node)
        self.names.drop_if_unused(node)
