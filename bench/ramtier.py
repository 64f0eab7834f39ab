"""The RAM tier against raw tmpfs: the data path of a single node.

Every group writes and reads with bench/iotool.c on both sides, times
open() to close() (mtcfs seals a file at close), and deletes its files
between reps, untimed, on both sides.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
from pathlib import Path

from common import (
    BenchError,
    Context,
    GiB,
    KiB,
    MiB,
    Row,
    drop_caches,
    err,
    fmt,
    median,
    mib_s,
)


def seq_write(ctx: Context) -> list[Row]:
    """One file of --size written front to back, fsync, close: 1 MiB, 4 KiB
    and 64 KiB write() calls."""
    size = ctx.size
    mnt = ctx.mtcfs().path / "seq-write"
    ref = ctx.ref_dir() / "seq-write"

    def one(path: Path, bs: int) -> float:
        t = ctx.io.write(path, size, bs, fsync=True)
        path.unlink()
        return mib_s(size, t)

    per_write = requests_per_write(ctx)
    probe = (
        "FUSE requests per 4 KiB write() call: "
        + ("not measurable" if per_write is None else f"{per_write:.2f}")
        + " (~1 = a GETXATTR security.capability round trip each)"
    )
    rows = []
    for bs, target, note in (
        (MiB, 0.35, ""),
        (4 * KiB, 0.25, probe),
        (64 * KiB, None, "for context"),
    ):
        name = f"sequential write, {_size(bs)} writes"
        xs, ys = ctx.alternate(lambda b=bs: one(mnt, b), lambda b=bs: one(ref, b), label=name)
        rows.append(
            Row("write", f"{_size(size)} {name}", "MiB/s", xs, ys, min_ratio=target, note=note)
        )
    return rows


def requests_per_write(ctx: Context, calls: int = 4096) -> float | None:
    """FUSE requests the daemon receives per 4 KiB write() call (all kinds).

    With the writeback cache, small write() calls are merged into large FUSE
    WRITEs, but unless libfuse negotiates FUSE_HANDLE_KILLPRIV_V2 the kernel
    asks the daemon for security.capability (GETXATTR) on every write() call.
    Counted from the daemon's read() calls on /dev/fuse, calibrated with
    GETXATTRs from here (exactly one request each)."""
    m = ctx.mtcfs()
    path = m.path / "probe"
    before = m.read_syscalls()
    ctx.io.write(path, calls * 4 * KiB, 4 * KiB, fsync=True)
    per_write = (m.read_syscalls() - before) / calls
    before = m.read_syscalls()
    for _ in range(1000):
        with contextlib.suppress(OSError):
            os.getxattr(path, "user.mtcfs-bench-probe")
    per_request = (m.read_syscalls() - before) / 1000
    path.unlink()
    # None if the daemon does not read() /dev/fuse (splice): nothing to count.
    return per_write / per_request if per_request > 0.5 else None


def seq_read(ctx: Context) -> list[Row]:
    """One file of --size read front to back with 1 MiB reads: cold (page
    cache dropped before every rep on both sides, so mtcfs serves the data
    from the daemon; tmpfs data is its own page cache and stays), then warm
    (read again at once: mtcfs opens with keep_cache)."""
    size = ctx.size
    mnt = ctx.mtcfs().path / "seq-read"
    ref = ctx.ref_dir() / "seq-read"
    for path in (mnt, ref):
        ctx.io.write(path, size, MiB, fsync=True)

    def read(path: Path) -> float:
        t, n = ctx.io.read(path, MiB)
        if n != size:
            raise BenchError(f"read {n} bytes of {path}, expected {size}")
        return mib_s(size, t)

    def one(path: Path) -> tuple[float, float]:
        drop_caches()
        cold = read(path)
        return cold, read(path)

    try:
        xs, ys = ctx.alternate(lambda: one(mnt), lambda: one(ref), label="read cold/warm")
    finally:
        mnt.unlink(missing_ok=True)
        ref.unlink(missing_ok=True)
    name = f"{_size(size)} sequential read, 1 MiB reads"
    return [
        Row("read", f"{name}, cold page cache", "MiB/s", [x[0] for x in xs], [y[0] for y in ys]),
        Row("read", f"{name}, warm page cache", "MiB/s", [x[1] for x in xs], [y[1] for y in ys]),
    ]


def create_files(
    ctx: Context, nfiles: int = 2000, ndirs: int = 20, file_size: int = 64 * KiB
) -> list[Row]:
    """`nfiles` files of `file_size` in `ndirs` new directories: mkdir, then
    open/write/close each file (no fsync)."""
    counter = itertools.count()

    def one(base: Path) -> float:
        root = base / f"tree-{next(counter)}"
        root.mkdir()
        t = ctx.io.tree(root, ndirs, nfiles, file_size, file_size, fsync=False)
        shutil.rmtree(root)
        return nfiles / t

    name = f"create {nfiles:,} files of {_size(file_size)} in {ndirs} dirs"
    xs, ys = ctx.alternate(
        lambda: one(ctx.mtcfs().path), lambda: one(ctx.ref_dir()), label="create"
    )
    return [Row("files", name, "files/s", xs, ys)]


def metadata_cost(ctx: Context, nfiles: int = 1024) -> list[Row]:
    """--size written as one file, then as `nfiles` files of --size/nfiles in
    one directory, each file fsync'ed and closed like a torch.distributed
    .checkpoint shard: the difference is the per-file cost."""
    size = ctx.size
    small = size // nfiles
    counter = itertools.count()

    def one(base: Path) -> tuple[float, float]:
        big = base / "meta-one"
        t1 = ctx.io.write(big, size, MiB, fsync=True)
        big.unlink()
        root = base / f"meta-many-{next(counter)}"
        root.mkdir()
        t2 = ctx.io.tree(root, 1, nfiles, small, min(MiB, small), fsync=True)
        shutil.rmtree(root)
        return t1, t2

    xs, ys = ctx.alternate(
        lambda: one(ctx.mtcfs().path), lambda: one(ctx.ref_dir()), label="1 file / many files (s)"
    )
    many = f"{nfiles:,} files of {_size(small)}"
    return [
        Row(
            "meta",
            f"{_size(size)} as 1 file, fsync",
            "MiB/s",
            [mib_s(size, t1) for t1, _ in xs],
            [mib_s(size, t1) for t1, _ in ys],
        ),
        Row(
            "meta",
            f"{_size(size)} as {many}, fsync each",
            "MiB/s",
            [mib_s(size, t2) for _, t2 in xs],
            [mib_s(size, t2) for _, t2 in ys],
        ),
        Row(
            "meta",
            f"per-file cost: (T {many} - T 1 file) / {nfiles:,}",
            "µs",
            [(t2 - t1) / nfiles * 1e6 for t1, t2 in xs],
            [(t2 - t1) / nfiles * 1e6 for t1, t2 in ys],
            higher_is_better=False,
            compare=False,
            note="no ratio: the tmpfs cost is a few µs, below the run-to-run noise",
        ),
    ]


def daemon_rss(ctx: Context, factor: int = 4) -> list[Row]:
    """Peak resident memory (VmHWM) of a fresh daemon after writing
    `factor` x --size as one file with 1 MiB writes."""
    size = factor * ctx.size
    ram_size = f"{max(6, math.ceil(size * 1.5 / GiB))}GiB"
    peaks: list[float] = []
    idle: list[float] = []
    speed: list[float] = []
    for i in range(ctx.reps):
        m = ctx.scratch.mount("rss", ram_size)
        try:
            idle.append(m.memory("VmHWM") / MiB)
            t = ctx.io.write(m.path / "big", size, MiB, fsync=True)
            peaks.append(m.memory("VmHWM") / MiB)
            speed.append(mib_s(size, t))
        finally:
            ctx.scratch.unmount(m)
        err.print(
            f"  rss: rep {i + 1}/{ctx.reps}: VmHWM {fmt(peaks[-1])} MiB "
            f"(idle {fmt(idle[-1])} MiB), wrote at {fmt(speed[-1])} MiB/s",
            style="dim",
        )
    note = f"idle daemon {fmt(median(idle))} MiB, --ram-size {ram_size}"
    return [
        Row(
            "memory",
            f"daemon peak RSS (VmHWM) writing {_size(size)}",
            "MiB",
            peaks,
            higher_is_better=False,
            max_value=200,
            note=note,
        )
    ]


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
