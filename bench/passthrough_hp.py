"""FUSE passthrough reference figures: libfuse's passthrough_hp with passthrough
on and off, beside raw tmpfs, in one run. Started by bench/passthrough_hp.sh,
which builds passthrough_hp (never part of this repository):

    bench/passthrough_hp.sh [--size SIZE] [--runs N] [--threads N]

Both passthrough_hp mounts mirror their own tmpfs directory and stay mounted
for the whole run; each figure is measured on the three targets in rotating
order (tmpfs, on, off; on, off, tmpfs; ...) and the median of --runs is shown.
Writes: one file of SIZE written front to back (a fresh file each time), timed
with bench/iotool.c from open() to after close(), close included, no fsync.
Reads: the whole file in 1 MiB reads; "cold" after dropping the page cache
(the FUSE file's cache only: tmpfs data stays in memory), "warm" right after
a first, untimed read.

passthrough_hp --nopassthrough runs with the writeback cache and keep_cache
(its default with an attribute timeout), passthrough_hp with passthrough
without them (the kernel refuses them together). Results go to
bench/results/passthrough_hp.json. Needs root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from common import (
    BENCH_DIR,
    BenchError,
    GiB,
    IoTool,
    KiB,
    MiB,
    Scratch,
    drop_caches,
    err,
    force_unmount,
    median,
    mib_s,
)

from mtcfs.config import mount_entry, parse_size

TARGETS = ("tmpfs", "passthrough", "nopassthrough")


class PassthroughHp:
    """One passthrough_hp daemon (foreground) mirroring `source` at `mountpoint`."""

    def __init__(self, binary: Path, source: Path, mountpoint: Path, passthrough: bool,
                 threads: int) -> None:
        self.mountpoint = mountpoint
        mountpoint.mkdir(exist_ok=True)
        self.log = mountpoint.parent / f"{mountpoint.name}.log"
        args = [str(binary), str(source), str(mountpoint), "--foreground",
                f"--num-threads={threads}"]
        if not passthrough:
            args.append("--nopassthrough")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while mount_entry(str(mountpoint)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"passthrough_hp did not mount: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        force_unmount(self.mountpoint)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", type=Path, required=True, help="passthrough_hp")
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--threads", type=int, default=-1,
                   help="passthrough_hp --num-threads (default: its own, -1)")
    args = p.parse_args()
    size = parse_size(args.size)
    scratch = Scratch()
    daemons: list[PassthroughHp] = []
    try:
        tool = IoTool(scratch.tmp)
        dirs = {"tmpfs": scratch.shm_dir("tmpfs")}
        for name in TARGETS[1:]:
            d = PassthroughHp(args.binary, scratch.shm_dir(f"src-{name}"),
                              scratch.tmp / f"mnt-{name}", name == "passthrough", args.threads)
            daemons.append(d)
            dirs[name] = d.mountpoint
        files = {t: dirs[t] / "f" for t in TARGETS}

        def write(bs: int) -> Callable[[str], float]:
            def one(t: str) -> float:
                files[t].unlink(missing_ok=True)
                return tool.write(files[t], size, bs, fsync=False)
            return one

        def read(cold: bool) -> Callable[[str], float]:
            def one(t: str) -> float:
                if cold:
                    drop_caches()
                else:
                    tool.read(files[t], MiB)  # whatever dropped the cache before
                seconds, n = tool.read(files[t], MiB)
                if n != size:
                    raise BenchError(f"read {n} bytes of {size} from {files[t]}")
                return seconds
            return one

        figures = [
            ("write, 1 MiB writes", write(MiB)),
            ("write, 4 KiB writes", write(4 * KiB)),
            ("read, cold, 1 MiB reads", read(True)),
            ("read, warm, 1 MiB reads", read(False)),
        ]
        results = []
        for name, fn in figures:
            times: dict[str, list[float]] = {t: [] for t in TARGETS}
            for run in range(args.runs):
                order = TARGETS[run % 3:] + TARGETS[:run % 3]
                for t in order:
                    times[t].append(fn(t))
                err.print(f"{name}, run {run + 1}/{args.runs}: "
                          + ", ".join(f"{t} {mib_s(size, times[t][-1]):,.0f}" for t in TARGETS)
                          + " MiB/s")
            speeds = {t: [mib_s(size, s) for s in times[t]] for t in TARGETS}
            results.append({"figure": name, "mib_s": speeds,
                            "median": {t: median(v) for t, v in speeds.items()}})
        for d in daemons:
            if "disabling rw passthrough" in d.log.read_text():
                raise BenchError(f"passthrough_hp fell back to no passthrough: {d.log}")
    finally:
        for d in daemons:
            d.stop()
        scratch.close()

    print(f"\n{format(size / GiB, 'g')} GiB file, median of {args.runs} runs, MiB/s "
          f"(passthrough_hp: libfuse example, on = passthrough, off = --nopassthrough)")
    print(f"{'':26} {'tmpfs':>8} {'on':>8} {'off':>8} {'on/tmpfs':>9} {'off/tmpfs':>10} "
          f"{'on/off':>7}")
    for r in results:
        m = r["median"]
        tm, on, off = m["tmpfs"], m["passthrough"], m["nopassthrough"]
        print(f"{r['figure']:26} {tm:8,.0f} {on:8,.0f} {off:8,.0f} {on / tm:9.2f} "
              f"{off / tm:10.2f} {on / off:7.2f}")
    out = BENCH_DIR / "results" / "passthrough_hp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(), "cpus": os.cpu_count(), "size": size,
        "runs": args.runs, "threads": args.threads, "results": results,
    }, indent=1))
    print(f"details: {out}")


if __name__ == "__main__":
    main()
