"""The data path: mtcfs with FUSE passthrough and through the daemon, beside raw
tmpfs and libfuse's own passthrough example (passthrough_hp), in one run.

Four targets, each figure measured on all four in rotating order per rep:

    tmpfs        a plain directory on /dev/shm (the reference of every ratio)
    passthrough  mtcfs --data-path passthrough (reads and writes bypass the daemon)
    fuse         mtcfs --data-path fuse (every request through the daemon)
    libfuse      libfuse's example/passthrough_hp with passthrough, over tmpfs

Figures: --size written with 1 MiB and with 4 KiB write() calls (open to close,
no fsync), read with 1 MiB reads cold (page cache dropped) and warm, 2,000 files
of 64 KiB created in 20 directories; for mtcfs with passthrough, the time from
close() of a --size file to its seal (the checksum is taken at the last release,
after close() has returned).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from common import (
    BENCH_DIR,
    BenchError,
    Context,
    GiB,
    KiB,
    MiB,
    Row,
    drop_caches,
    err,
    mib_s,
)
from passthrough_hp import PassthroughHp

TARGETS = ("tmpfs", "passthrough", "fuse", "libfuse")


def _libfuse_binary() -> Path:
    r = subprocess.run([str(BENCH_DIR / "passthrough_hp.sh"), "--build-only"],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise BenchError(f"passthrough_hp could not be built: {r.stderr.strip()[-500:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def group(ctx: Context) -> list[Row]:
    size = ctx.size
    scratch = ctx.scratch
    pt = scratch.mount("dp-passthrough", ctx.ram_size, ["--data-path", "passthrough"])
    fu = scratch.mount("dp-fuse", ctx.ram_size, ["--data-path", "fuse"])
    if pt.status()["data_path"] != "passthrough":
        raise BenchError("mtcfs --data-path passthrough did not get passthrough")
    hp = PassthroughHp(_libfuse_binary(), scratch.shm_dir("dp-libfuse-src"),
                       scratch.tmp / "dp-libfuse", passthrough=True, threads=-1)
    scratch.defer(hp.stop)
    dirs = {"tmpfs": scratch.shm_dir("dp-tmpfs"), "passthrough": pt.path, "fuse": fu.path,
            "libfuse": hp.mountpoint}
    counter = itertools.count()

    def per_target(fn: Callable[[str], float]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {t: [] for t in TARGETS}
        for t in TARGETS:  # warm-up, untimed
            fn(t)
        for rep in range(ctx.reps):
            order = TARGETS[rep % 4:] + TARGETS[:rep % 4]
            for t in order:
                out[t].append(fn(t))
        return out

    def write(bs: int) -> Callable[[str], float]:
        def one(t: str) -> float:
            f = dirs[t] / "w"
            f.unlink(missing_ok=True)
            seconds = ctx.io.write(f, size, bs, fsync=False)
            return mib_s(size, seconds)
        return one

    def read(cold: bool) -> Callable[[str], float]:
        def one(t: str) -> float:
            f = dirs[t] / "r"
            if cold:
                drop_caches()
            else:
                ctx.io.read(f, MiB)
            seconds, n = ctx.io.read(f, MiB)
            if n != size:
                raise BenchError(f"read {n} bytes of {size} from {f}")
            return mib_s(size, seconds)
        return one

    def create(t: str) -> float:
        root = dirs[t] / f"tree-{next(counter)}"
        root.mkdir()
        seconds = ctx.io.tree(root, 20, 2000, 64 * KiB, 64 * KiB, fsync=False)
        shutil.rmtree(root)
        return 2000 / seconds

    results: list[tuple[str, str, dict[str, list[float]]]] = []
    for bs, label in ((MiB, "1 MiB"), (4 * KiB, "4 KiB")):
        name = f"{_size(size)} sequential write, {label} writes"
        err.print(f"  {name}")
        results.append((name, "MiB/s", per_target(write(bs))))
    for t in TARGETS:
        ctx.io.write(dirs[t] / "r", size, MiB, fsync=True)
    for cold in (True, False):
        name = f"{_size(size)} sequential read, 1 MiB reads, {'cold' if cold else 'warm'}"
        err.print(f"  {name}")
        results.append((name, "MiB/s", per_target(read(cold))))
    err.print("  create 2,000 files of 64 KiB")
    results.append(("create 2,000 files of 64 KiB in 20 dirs", "files/s", per_target(create)))

    rows = []
    for name, unit, by in results:
        hp_median = sorted(by["libfuse"])[len(by["libfuse"]) // 2]
        for t, label in (("passthrough", "mtcfs passthrough"), ("fuse", "mtcfs fuse"),
                         ("libfuse", "libfuse passthrough_hp")):
            mid = sorted(by[t])[len(by[t]) // 2]
            note = (f"{mid / hp_median:.2f}x of libfuse passthrough_hp"
                    if t != "libfuse" and hp_median else "")
            rows.append(Row("datapath", f"{name}: {label}", unit, by[t], by["tmpfs"],
                            note=note))
    rows.append(_seal_time(ctx, pt.path))
    (BENCH_DIR / "results").mkdir(exist_ok=True)
    (BENCH_DIR / "results" / "datapath.json").write_text(json.dumps(
        {name: by for name, _, by in results}, indent=1))
    return rows


def _seal_time(ctx: Context, mnt: Path) -> Row:
    """close() -> sealed, per GiB, with passthrough (the checksum pass at release)."""
    size = ctx.size
    per_gib = []
    for rep in range(ctx.reps):
        f = mnt / f"seal-{rep}"
        ctx.io.write(f, size, MiB, fsync=False)
        t0 = time.monotonic()
        while json.loads(os.getxattr(f, "user.mtcfs.state"))["state"] != "closed":
            if time.monotonic() - t0 > 120:
                raise BenchError(f"{f} not sealed after 120 s")
            time.sleep(0.002)
        per_gib.append((time.monotonic() - t0) / (size / GiB))
        f.unlink()
    return Row("datapath", "passthrough: close() -> sealed (checksum at release), per GiB",
               "s", per_gib, higher_is_better=False,
               note="after close() has returned; fsync/commits seal at once")


def _size(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"
