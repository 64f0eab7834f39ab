"""Path-based calls on an in-process mount's `Filesystem` (see conftest.py)."""

from __future__ import annotations

import errno
import os
import stat
import time
from typing import Any

import trio

from mtcfs.assembly import Mount
from mtcfs.core.namespace import ROOT, Inode
from mtcfs.fs.filesystem import FsError, NeedRoom


class Host:
    """One mount's filesystem, with path-based calls (what a process would do
    through the mount: the same sequence of operations the kernel sends)."""

    def __init__(self, mount: Mount, uid: int = 0) -> None:
        self.mount = mount
        self.fs = mount.fs
        self.names = mount.fs.names
        self.ns = mount.ns
        self.uid = uid

    # -- names ----------------------------------------------------------------------------

    def node(self, path: str) -> Inode:
        node = self.ns.inodes[ROOT]
        for comp in [c for c in path.split("/") if c]:
            node = self.names.lookup(node.ino, comp.encode())
        return node

    def parent(self, path: str) -> tuple[Inode, bytes]:
        head, _, name = path.rstrip("/").rpartition("/")
        return self.node(head), name.encode()

    def exists(self, path: str) -> bool:
        try:
            self.node(path)
        except FsError as e:
            assert e.errno == errno.ENOENT
            return False
        return True

    def listdir(self, path: str = "") -> list[str]:
        d = self.node(path)
        fh = self.names.opendir(d)
        try:
            return sorted(name.decode() for _, name, _ in self.names.readdir(fh, 0))
        finally:
            self.names.releasedir(fh)

    # -- directory operations ---------------------------------------------------------------

    def mkdir(self, path: str, mode: int = 0o755) -> Inode:
        p, name = self.parent(path)
        return self.names.mkdir(p.ino, name, mode, self.uid, 0)

    def makedirs(self, path: str) -> None:
        parts = [c for c in path.split("/") if c]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if not self.exists(sub):
                self.mkdir(sub)

    def unlink(self, path: str) -> None:
        p, name = self.parent(path)
        self.fs.unlink(p.ino, name)

    def rmdir(self, path: str) -> None:
        p, name = self.parent(path)
        self.fs.rmdir(p.ino, name)

    async def rename(self, src: str, dst: str, flags: int = 0) -> None:
        (p1, n1), (p2, n2) = self.parent(src), self.parent(dst)
        await self.fs.rename(p1.ino, n1, p2.ino, n2, flags)

    def link(self, src: str, dst: str) -> Inode:
        p, name = self.parent(dst)
        return self.names.link(self.node(src), p.ino, name)

    def symlink(self, path: str, target: str) -> Inode:
        p, name = self.parent(path)
        return self.names.symlink(p.ino, name, target.encode(), self.uid, 0)

    # -- files ------------------------------------------------------------------------------

    async def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & os.O_CREAT and not self.exists(path):
            p, name = self.parent(path)
            fh, _ = self.fs.create(p.ino, name, mode, flags, self.uid, 0)
            return fh
        return await self.fs.open(self.node(path), flags, self.uid)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        try:
            return self.fs.write(fh, off, data)
        except NeedRoom as e:
            return await self.fs.write_after_room(fh, off, data, e.need)

    async def close(self, fh: int) -> None:
        await self.fs.flush(fh)
        await self.fs.release(fh)

    async def write_file(self, path: str, data: bytes, *, fsync: bool = False,
                         chunk: int = 128 << 10, flags: int = 0) -> Inode:
        fh = await self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
        try:
            for off in range(0, len(data), chunk):
                await self.write(fh, off, data[off:off + chunk])
            if fsync:
                await self.fs.fsync(fh)
        finally:
            await self.close(fh)
        return self.node(path)

    async def read_file(self, path: str, chunk: int = 128 << 10) -> bytes:
        fh = await self.open(path, os.O_RDONLY)
        try:
            size = self.node(path).size
            out = bytearray()
            while len(out) < size:
                piece = await self.fs.read(fh, len(out), min(chunk, size - len(out)))
                if not piece:
                    break
                out += piece
            return bytes(out)
        finally:
            await self.close(fh)

    def state(self, path: str) -> dict[str, Any]:
        return self.mount.view.state_of(self.node(path))

    def mode(self, path: str) -> int:
        return stat.S_IMODE(self.node(path).mode)


async def until(cond, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll cond() under trio until it is true; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(0.01)
