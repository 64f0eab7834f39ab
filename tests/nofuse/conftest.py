"""The in-process layer: a mount's parts built by mtcfs.assembly, as the daemon
builds them, and driven through `Filesystem` directly, without FUSE or /dev/fuse
(as s3ql's fs_api tests drive its Operations). Everything else is real: the RAM
tier's files, the metadata store (SQLite), a file:// durable tier, gRPC on
loopback between in-process hosts. The kernel's caches are the one part left
out: there is no kernel here, so its invalidations go nowhere.

Each module is marked `nofuse` (and `trio`): `make test-nofuse` runs them alone.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from mtcfs.assembly import Mount, build, open_ram
from mtcfs.config import build_options
from mtcfs.core.store import MetaStore
from mtcfs.fs.kernel import KernelCache
from mtcfs.fs.passthrough import Passthrough

from support.inprocess import Host


class MakeHost:
    """make_host(name="a", start=True, **mount options) -> Host; with start=False
    the peer tier is started later, with others: `await make_host.start(a, b)`
    (each waits for its peers to answer before it goes live, as daemons do)."""

    def __init__(self, tmp_path: Path, nursery: trio.Nursery) -> None:
        self.tmp_path = tmp_path
        self.nursery = nursery
        self.mounts: list[Mount] = []

    async def __call__(self, name: str = "a", *, start: bool = True, **cli: Any) -> Host:
        mnt = self.tmp_path / f"mnt-{name}"
        mnt.mkdir(exist_ok=True)
        options: dict[str, Any] = {"ram_dir": str(self.tmp_path / f"ram-{name}"),
                                   "ram_size": "64MiB", "node_id": name,
                                   "data_path": "fuse"}
        options.update(cli)
        opts = build_options(str(mnt), options, None)
        store = MetaStore(os.path.join(opts.ram_dir, "meta.db"))
        # No kernel: its cache invalidations go nowhere.
        kernel = KernelCache(lambda parent, name: None, lambda ino: None)
        mount = build(opts, store, open_ram(opts, own_tmpfs=False), kernel,
                      Passthrough.unused())
        self.mounts.append(mount)
        host = Host(mount)
        if start:
            await self.start(host)
        return host

    async def start(self, *hosts: Host) -> None:
        async with trio.open_nursery() as n:
            for h in hosts:
                n.start_soon(h.mount.start_peers, self.nursery)
        for h in hosts:
            h.mount.run_background(self.nursery)


@pytest.fixture
async def make_host(tmp_path: Path) -> AsyncIterator[MakeHost]:
    """In-process mounts whose background parts (fetches, uploads, peers, retention...)
    run until the test ends."""
    async with trio.open_nursery() as nursery:
        make = MakeHost(tmp_path, nursery)
        yield make
        nursery.cancel_scope.cancel()
    for m in make.mounts:
        m.stop()
        m.close()
