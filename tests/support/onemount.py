"""One in-process mount built over a directory, without the nofuse fixture's
background tasks: for tests that crash it and build it again over the same RAM dir
and metadata (a restart), or that play the kernel's passthrough."""

from __future__ import annotations

import os
from pathlib import Path

from mtcfs.assembly import Mount, build, open_ram
from mtcfs.config import build_options
from mtcfs.core.store import MetaStore
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.passthrough import Passthrough

from support.inprocess import Host


def mount_at(root: Path, *, passthrough: bool = False, **cli: object) -> Mount:
    """Host "a"'s mount over `root` (ram/, mnt/). With `passthrough` the kernel agreed
    to it: a handle whose first open may pass through gets a backing file."""
    (root / "mnt").mkdir(exist_ok=True)
    options = {"ram_dir": str(root / "ram"), "ram_size": "64MiB", "node_id": "a",
               "data_path": "fuse", **cli}
    opts = build_options(str(root / "mnt"), options, None)
    store = MetaStore(os.path.join(opts.ram_dir, "meta.db"))
    backing = (Passthrough(lambda fd: 1000 + fd, lambda backing_id: None) if passthrough
               else Passthrough.unused())
    if passthrough:
        backing.enable()  # as the daemon records the kernel's answer at INIT
    return build(opts, store, open_ram(opts, own_tmpfs=False),
                 KernelCache(lambda parent, name: None, lambda ino: None), backing)


def crash(m: Mount) -> None:
    """The daemon stops: no close, no seal; what is recorded stays."""
    m.stop()
    m.close()


async def remounted_after_a_crash_mid_write(root: Path, name: str = "f") -> Mount:
    """Host "a" wrote `name`, began writing it again and crashed; its mount built
    again over the same RAM dir and metadata."""
    m = mount_at(root)
    h = Host(m)
    await h.write_file(name, b"good")
    fh = await h.open(name, os.O_WRONLY)
    await h.write(fh, 0, b"BAD")
    crash(m)
    return mount_at(root)


def pt_write(h: Host, fh: int, off: int, data: bytes) -> None:
    """A write through passthrough: into the RAM file, the daemon told nothing."""
    handle = h.fs.handle(fh)
    assert handle.backing, "not opened with passthrough"
    os.pwrite(handle.fd, data, off)
