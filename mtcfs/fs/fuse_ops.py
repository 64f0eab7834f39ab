"""pyfuse3 adapter: translates FUSE requests to `Filesystem` calls and back.

No semantics live here: only argument and attribute conversion, and mapping
`FsError` to `FUSEError`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3

from mtcfs.core.namespace import Inode
from mtcfs.fs.filesystem import ALL_GROUPS, Filesystem, FsError, NeedRoom
from mtcfs.fs.state_view import STATE_XATTR, FileStateView

log = logging.getLogger(__name__)

# The namespace is only changed through this mount for now, so the kernel may
# cache entries and attributes for long; remote changes (peer tier) will be
# pushed with invalidate_entry/invalidate_inode.
ENTRY_TIMEOUT = 60.0
ATTR_TIMEOUT = 60.0
BLOCK = 4096

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_errors(fn: F) -> F:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            log.warning("%s failed: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


class FuseOperations(pyfuse3.Operations):
    enable_writeback_cache = True
    # Honoured by the pyfuse3 that `make bootstrap` builds (see docs/architecture.md).
    enable_killpriv_v2 = True
    supports_dot_lookup = True

    # Asked for with --data-path passthrough|auto (the patched pyfuse3 negotiates it,
    # and the writeback cache, which the kernel refuses with it, is then not asked for).
    enable_passthrough = False
    passthrough_stack_depth = 1  # backing files on tmpfs (depth 0): one more is allowed

    def __init__(self, fs: Filesystem, view: FileStateView, passthrough: bool = False) -> None:
        super().__init__()
        self.fs = fs
        self.names = fs.names  # directories, links, renames, removals
        self.xattrs = fs.xattrs
        self.view = view  # user.mtcfs.state
        if passthrough:
            self.enable_passthrough = True
            self.enable_writeback_cache = False

    def attrs(self, node: Inode) -> pyfuse3.EntryAttributes:
        self.fs.sealer.refresh(node)  # written through passthrough: size and mtime from RAM
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        a.st_size = node.size
        a.st_blksize = 1 << 20
        a.st_blocks = (self.fs.ram.charged(node.ino) + 511) // 512 if node.is_file else 0
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = node.mtime_ns
        a.st_ctime_ns = node.ctime_ns
        return a

    # -- namespace -------------------------------------------------------------

    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        return self.attrs(self.names.lookup(parent_inode, name))

    async def forget(self, inode_list):
        for ino, n in inode_list:
            self.names.forget(ino, n)

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        return self.attrs(self.fs.attributes_of(inode))

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self.fs.node(inode)
        await self.fs.setattr(
            node,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,
            caller_uid=ctx.uid,
            caller_in_group=_in_group(ctx, node),
        )
        return self.attrs(node)

    @fuse_errors
    async def readlink(self, inode, ctx):
        return self.names.readlink(self.fs.node(inode))

    @fuse_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self.attrs(self.names.mknod(parent_inode, name, mode & ~ctx.umask, rdev, ctx.uid,
                                        ctx.gid))

    @fuse_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self.attrs(self.names.mkdir(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid))

    @fuse_errors
    async def unlink(self, parent_inode, name, ctx):
        self.names.unlink(parent_inode, name)

    @fuse_errors
    async def rmdir(self, parent_inode, name, ctx):
        self.names.rmdir(parent_inode, name)

    @fuse_errors
    async def symlink(self, parent_inode, name, target, ctx):
        return self.attrs(self.names.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.names.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @fuse_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self.attrs(self.names.link(self.fs.node(inode), new_parent_inode, new_name))

    @fuse_errors
    async def opendir(self, inode, ctx):
        return self.names.opendir(self.fs.node(inode))

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        for next_id, name, node in self.names.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self.attrs(node), next_id):
                break
            node.lookups += 1  # readdir_reply counts as a lookup (readdirplus)

    async def releasedir(self, fh):
        self.names.releasedir(fh)

    @fuse_errors
    async def fsyncdir(self, fh, datasync):
        # Namespace changes are committed to the metadata store as they happen; what
        # is left is making them visible on every live peer.
        await self.names.fsyncdir(self.names.dir_handle(fh)[0])

    @fuse_errors
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        ram = self.fs.ram
        s.f_bsize = BLOCK
        s.f_frsize = BLOCK
        s.f_blocks = ram.capacity // BLOCK
        s.f_bfree = ram.free // BLOCK
        s.f_bavail = s.f_bfree
        s.f_files = 1 << 32
        s.f_ffree = s.f_files - len(self.fs.ns.inodes)
        s.f_favail = s.f_ffree
        s.f_namemax = 255
        return s

    # -- extended attributes -----------------------------------------------------

    @fuse_errors
    async def setxattr(self, inode, name, value, ctx):
        self.xattrs.setxattr(self.fs.node(inode), name, value)

    async def getxattr(self, inode, name, ctx):
        # The kernel asks for security.capability before every write() syscall
        # (libfuse 3.14 cannot negotiate HANDLE_KILLPRIV_V2), so answer it first.
        if name == b"security.capability" and not self.xattrs.has_caps:
            raise pyfuse3.FUSEError(errno.ENODATA)
        try:
            if name == STATE_XATTR:
                return self.view.xattr(self.fs.node(inode))
            return self.xattrs.getxattr(self.fs.node(inode), name)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    @fuse_errors
    async def listxattr(self, inode, ctx):
        return self.xattrs.listxattr(self.fs.node(inode))

    @fuse_errors
    async def removexattr(self, inode, name, ctx):
        self.xattrs.removexattr(self.fs.node(inode), name)

    # -- files -------------------------------------------------------------------

    def _open_flags(self, flags: int) -> int:
        # With the writeback cache the kernel resolves O_APPEND itself and
        # writes back whole pages at their real offsets: honouring O_APPEND
        # here again would move that data to the end of the file.
        return flags & ~os.O_APPEND if self.enable_writeback_cache else flags

    @fuse_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        flags = self._open_flags(flags)
        fh, node = self.fs.create(parent_inode, name, mode & ~ctx.umask, flags, ctx.uid, ctx.gid)
        return self._file_info(fh), self.attrs(node)

    @fuse_errors
    async def open(self, inode, flags, ctx):
        node = self.fs.node(inode)
        fh = await self.fs.open(node, self._open_flags(flags), ctx.uid, _member_of(ctx))
        return self._file_info(fh)

    def _file_info(self, fh: int) -> pyfuse3.FileInfo:
        backing = self.fs.handle(fh).backing
        if backing:  # the kernel refuses keep_cache with passthrough
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, backing_id=backing)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh, off, size):
        try:
            return await self.fs.read(fh, off, size)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

    async def write(self, fh, off, buf):
        # The hot path: no decorator, one call.
        try:
            return self.fs.write(fh, off, buf)
        except NeedRoom as e:
            try:
                return await self.fs.write_after_room(fh, off, buf, e.need)
            except FsError as e2:
                raise pyfuse3.FUSEError(e2.errno) from None
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    @fuse_errors
    async def flush(self, fh):
        await self.fs.flush(fh)

    @fuse_errors
    async def release(self, fh):
        await self.fs.release(fh)

    @fuse_errors
    async def fsync(self, fh, datasync):
        await self.fs.fsync(fh)

    @fuse_errors
    async def fallocate(self, fh, mode, offset, length):
        await self.fs.fallocate(fh, mode, offset, length)

    async def access(self, inode, mode, ctx):
        return True  # default_permissions: the kernel checks mode bits


def _in_group(ctx: Any, node: Inode) -> bool:
    """Is the caller in the file's group? Asked only where it decides something: an
    unprivileged caller and a set-group-ID file."""
    return not node.mode & stat.S_ISGID or _member_of(ctx)(node.gid)


def _member_of(ctx: Any) -> Callable[[int], bool]:
    """The caller's group membership, for its handle: every group for root."""
    return ALL_GROUPS if ctx.uid == 0 else CallerGroups(ctx.gid, ctx.pid)


class CallerGroups:
    """An unprivileged caller's groups: the kernel passes its primary group only; its
    other groups are read from /proc when first asked (rarely: an unprivileged
    writer of a set-group-ID file without group execute)."""

    def __init__(self, gid: int, pid: int) -> None:
        self.gid, self.pid = gid, pid
        self._asked = False
        self._others: set[int] | None = None

    def __call__(self, gid: int) -> bool:
        if gid == self.gid:
            return True
        if not self._asked:
            self._asked, self._others = True, _supplementary_groups(self.pid)
        return self._others is None or gid in self._others


def _supplementary_groups(pid: int) -> set[int] | None:
    """None: the process is gone (counted as in every group, as before this rule)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return None


def mount_options(fsname: str, extra: list[str]) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.add(f"fsname={fsname}")
    opts.add("subtype=mtcfs")
    opts.update(("nosuid", "nodev"))  # see scripts/build_pyfuse3.sh (KILLPRIV_V2)
    opts.update(extra)
    return opts


def raise_read_ahead(mountpoint: str, kib: int = 16384) -> None:
    """FUSE mounts get a 128 KiB read-ahead by default; checkpoint loads read
    big files front to back, so ask for much more. Must run off the trio
    thread that serves the mount (it stats the mountpoint)."""
    st = os.stat(mountpoint)
    path = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as e:
        log.info("could not raise read-ahead (%s): %s", path, e)
