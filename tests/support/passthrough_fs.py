"""A tiny pyfuse3 file system for tests/test_pyfuse3_passthrough.py.

One directory; each file is backed by the file of the same name in BACKING_DIR
(tmpfs) and opened with FUSE passthrough: the backing file is registered with
pyfuse3.backing_open (one backing id per inode, shared by all its opens,
released on the last release) and handed to the kernel in FileInfo.backing_id.
Run it as a subprocess, never in the test process (a blocking call on a mount
from the thread that serves it deadlocks):

    python tests/support/passthrough_fs.py MOUNTPOINT BACKING_DIR [--no-passthrough]

--no-passthrough: the Operations class does not ask for passthrough; opens try
backing_open anyway, record the error, and fall back to ordinary opens.

Control, through extended attributes (served by this daemon):
- getxattr(root, "user.ptfs.stats"): JSON with passthrough_enabled, the
  requests received per operation and file name, the opens per mode, the live
  backing ids and the backing_open errors.
- getxattr(root, "user.ptfs.probe"): JSON of backing_open/backing_close calls
  that must fail (unknown id, bad fd, directory, pipe) and their errors.
- setxattr(file, "user.ptfs.mode", MODE): how the next opens of that file are
  answered: "passthrough" (default), "cached" (ordinary open, page cache),
  "direct" (ordinary open, direct_io), "new-backing" (passthrough with a
  backing id of its own instead of the inode's).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from collections import Counter
from dataclasses import dataclass, field

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE
MODES = ("passthrough", "cached", "direct", "new-backing")


@dataclass
class Node:
    name: str
    mode: str = "passthrough"
    backing_id: int = 0  # the inode's backing id, shared by its passthrough opens
    passthrough_opens: int = 0


@dataclass
class Handle:
    ino: int
    mode: str
    fd: int = -1  # the daemon's own fd for reads/writes of non-passthrough opens
    own_backing_id: int = 0  # "new-backing"


@dataclass
class Stats:
    ops: Counter = field(default_factory=Counter)  # "read:name" -> count
    opens: Counter = field(default_factory=Counter)  # mode -> count
    backing_errors: list = field(default_factory=list)


def os_error(e: OSError) -> dict:
    return {"errno": errno.errorcode.get(e.errno or 0, str(e.errno)), "message": str(e)}


class PassthroughFs(pyfuse3.Operations):
    def __init__(self, backing_dir: str, passthrough: bool) -> None:
        super().__init__()
        self.enable_passthrough = passthrough
        # As mtcfs asks for them. The patch must not request the writeback cache
        # with passthrough (the kernel would refuse passthrough, backing_open
        # fail). Without KILLPRIV_V2 every write() syscall costs a
        # GETXATTR(security.capability) request, passthrough or not.
        self.enable_writeback_cache = True
        self.enable_killpriv_v2 = True
        self.dir = backing_dir
        self.nodes: dict[int, Node] = {}
        self.inos: dict[str, int] = {}
        self.handles: dict[int, Handle] = {}
        self.next_fh = 1
        self.stats = Stats()

    # -- helpers -----------------------------------------------------------------------------

    def path(self, ino: int) -> str:
        return os.path.join(self.dir, self.nodes[ino].name)

    def node_for(self, name: str) -> int:
        ino = self.inos.get(name)
        if ino is None:
            ino = self.inos[name] = len(self.inos) + ROOT + 1
            self.nodes[ino] = Node(name)
        return ino

    def count(self, op: str, ino: int) -> None:
        self.stats.ops[f"{op}:{self.nodes[ino].name if ino in self.nodes else ino}"] += 1

    def attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        try:
            st = os.stat(self.dir if ino == ROOT else self.path(ino))
        except (OSError, KeyError):
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        a = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks",
                     "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, name, getattr(st, name))
        a.st_ino = ino
        a.st_blksize = 4096
        a.attr_timeout = 0  # sizes change behind the daemon's back (passthrough writes)
        a.entry_timeout = 0
        return a

    def new_backing_id(self, ino: int) -> int:
        fd = os.open(self.path(ino), os.O_RDWR)
        try:
            return pyfuse3.backing_open(fd)
        finally:
            os.close(fd)  # the kernel keeps its own reference

    def open_handle(self, ino: int, flags: int) -> pyfuse3.FileInfo:
        node = self.nodes[ino]
        if flags & os.O_TRUNC:
            os.truncate(self.path(ino), 0)
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        mode = node.mode
        if mode in ("passthrough", "new-backing"):
            try:
                if mode == "new-backing":
                    backing_id = self.new_backing_id(ino)
                    self.handles[fh] = Handle(ino, mode, own_backing_id=backing_id)
                else:
                    if not node.backing_id:
                        node.backing_id = self.new_backing_id(ino)
                    backing_id = node.backing_id
                    node.passthrough_opens += 1
                    self.handles[fh] = Handle(ino, mode)
                self.stats.opens[mode] += 1
                # keep_cache keeps its default (True): the patch must drop it.
                return pyfuse3.FileInfo(fh=fh, backing_id=backing_id)
            except OSError as e:
                self.stats.backing_errors.append(os_error(e))
                mode = "cached"
        self.handles[fh] = Handle(ino, mode, fd=os.open(self.path(ino), os.O_RDWR))
        self.stats.opens[mode] += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=mode == "direct", keep_cache=False)

    def probe(self) -> dict:
        """backing_open/backing_close calls that must fail, and how they fail."""
        out: dict = {}

        def attempt(key: str, fn, *args) -> None:
            try:
                out[key] = {"ok": fn(*args)}
            except OSError as e:
                out[key] = os_error(e)

        attempt("close_unknown", pyfuse3.backing_close, 987654)
        attempt("close_zero", pyfuse3.backing_close, 0)
        attempt("open_bad_fd", pyfuse3.backing_open, -1)
        dirfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        attempt("open_directory", pyfuse3.backing_open, dirfd)
        os.close(dirfd)
        r, w = os.pipe()
        attempt("open_pipe", pyfuse3.backing_open, r)
        os.close(r)
        os.close(w)
        path = os.path.join(self.dir, ".probe")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink(path)
        attempt("open_file", pyfuse3.backing_open, fd)
        os.close(fd)
        if "ok" in out["open_file"]:
            attempt("close_file", pyfuse3.backing_close, out["open_file"]["ok"])
            attempt("close_file_again", pyfuse3.backing_close, out["open_file"]["ok"])
        return out

    # -- requests ------------------------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx):
        self.count("lookup", parent_inode)
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOENT)
        name = os.fsdecode(name)
        if name in (".", ".."):
            return self.attrs(ROOT)
        if not os.path.lexists(os.path.join(self.dir, name)):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attrs(self.node_for(name))

    async def getattr(self, inode, ctx=None):
        self.count("getattr", inode)
        return self.attrs(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        self.count("setattr", inode)
        path = self.path(inode)
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        if fields.update_atime or fields.update_mtime:
            st = os.stat(path)
            os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                               attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        return self.attrs(inode)

    async def opendir(self, inode, ctx):
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return 0

    async def readdir(self, fh, start_id, token):
        names = sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        for i, name in enumerate(names[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, os.fsencode(name),
                                         self.attrs(self.node_for(name)), i):
                break

    async def create(self, parent_inode, name, mode, flags, ctx):
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOENT)
        name = os.fsdecode(name)
        os.close(os.open(os.path.join(self.dir, name), os.O_RDWR | os.O_CREAT, mode & 0o7777))
        ino = self.node_for(name)
        self.count("create", ino)
        return self.open_handle(ino, flags), self.attrs(ino)

    async def open(self, inode, flags, ctx):
        self.count("open", inode)
        return self.open_handle(inode, flags)

    async def read(self, fh, off, size):
        h = self.handles[fh]
        self.count("read", h.ino)
        return os.pread(h.fd, size, off)

    async def write(self, fh, off, buf):
        h = self.handles[fh]
        self.count("write", h.ino)
        return os.pwrite(h.fd, buf, off)

    async def flush(self, fh):
        self.count("flush", self.handles[fh].ino)

    async def fsync(self, fh, datasync):
        self.count("fsync", self.handles[fh].ino)

    async def release(self, fh):
        h = self.handles.pop(fh)
        self.count("release", h.ino)
        node = self.nodes[h.ino]
        if h.fd >= 0:
            os.close(h.fd)
        if h.own_backing_id:
            pyfuse3.backing_close(h.own_backing_id)
        if h.mode == "passthrough":
            node.passthrough_opens -= 1
            if not node.passthrough_opens:
                pyfuse3.backing_close(node.backing_id)
                node.backing_id = 0

    async def unlink(self, parent_inode, name, ctx):
        self.count("unlink", parent_inode)
        try:
            os.unlink(os.path.join(self.dir, os.fsdecode(name)))
        except FileNotFoundError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def getxattr(self, inode, name, ctx):
        self.count("getxattr", inode)
        if inode == ROOT and name == b"user.ptfs.stats":
            live = {n.name: n.backing_id for n in self.nodes.values() if n.backing_id}
            live.update({f"{self.nodes[h.ino].name}#{fh}": h.own_backing_id
                         for fh, h in self.handles.items() if h.own_backing_id})
            return json.dumps({
                "passthrough_enabled": pyfuse3.passthrough_enabled(),
                "ops": dict(self.stats.ops),
                "opens": dict(self.stats.opens),
                "live_backing_ids": live,
                "backing_errors": self.stats.backing_errors,
            }).encode()
        if inode == ROOT and name == b"user.ptfs.probe":
            return json.dumps(self.probe()).encode()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def setxattr(self, inode, name, value, ctx):
        self.count("setxattr", inode)
        if inode != ROOT and name == b"user.ptfs.mode" and value.decode() in MODES:
            self.nodes[inode].mode = value.decode()
            return
        raise pyfuse3.FUSEError(errno.ENOTSUP)


def main() -> None:
    mountpoint, backing_dir, *rest = sys.argv[1:]
    fs = PassthroughFs(backing_dir, passthrough="--no-passthrough" not in rest)
    options = set(pyfuse3.default_options) | {"fsname=ptfs"}
    pyfuse3.init(fs, mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
