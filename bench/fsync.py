"""The cost of each --fsync level (local, replicas, gcs), beside raw tmpfs.

Three pairs of peered daemons on loopback run side by side, one pair per
level: hosts `<level>-a` and `<level>-b`, `--listen 127.0.0.1:P --peers ...
--token-file F --replicas 1 --fsync <level>`, both over one fake-gcs-server
(tests/support/gcs_server.py, filesystem backend in /dev/shm) with `--bucket
gs://mtcfs-bench/fsync-<level> --persist manual`: nothing is uploaded unless
an fsync asks for it. The trainer writes on host a. The reference is a plain
directory on the same tmpfs, with the same fsync calls.

Workloads (each timed from the first open to the last close, fsync included):

1. one file of min(256 MiB, --size) written with 1 MiB writes, fsync, close
   (bench/iotool.c);
2. 100 files of 64 KiB, each open, write, fsync, close (bench/iotool.c);
3. a torch-DCP-like step: mkdir the step directory, 4 shards of a quarter of
   workload 1's size each written with 1 MiB writes, fsync'd and closed, then
   `.metadata.tmp` (64 KiB) written, fsync'd, closed and renamed to
   `.metadata` (in this process: os.write loops, same calls on both sides).

Every rep runs the four sides (tmpfs, local, replicas, gcs) in an order that
rotates from rep to rep, after one untimed warm-up run each. After each run,
untimed: the level is checked on host a (`user.mtcfs.state`: replicas >= 1
for `replicas`, persisted for `gcs`), the background copies finish, the files
are removed, and the bench waits until both hosts have nothing left to
replicate, broadcast, upload or delete and the daemons and the server are idle
(< 10% of a CPU over 0.3 s).

Each level gets a row against tmpfs, and `replicas` and `gcs` a row against
`local` too (ratio < 1: slower). Warning and error lines of the daemons' logs
and per-rep values go to bench/results/fsync.json. Everything started here is
also registered with Scratch.defer, so it is stopped after an error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    BenchError,
    Context,
    KiB,
    MiB,
    Mount,
    Row,
    code_version,
    err,
    fmt,
    median,
    save_details,
)
from durable import Gcs, _quiesce
from peers import family, free_ports, state, status
from ramtier import _size

LEVELS = ("local", "replicas", "gcs")
SMALL_FILES, SMALL_SIZE = 100, 64 * KiB
SHARDS = 4
METADATA_SIZE = 64 * KiB
DETAILS = BENCH_DIR / "results" / "fsync.json"
LOG_MARKS = (
    " WARNING ",
    " ERROR ",
    " CRITICAL ",
    "Traceback",
    '"severity": "WARNING"',
    '"severity": "ERROR"',
)


class Pair:
    """Two peered daemons with one --fsync level, over the group's bucket."""

    def __init__(self, ctx: Context, gcs: Gcs, level: str, token: Path) -> None:
        self.level = level
        pa, pb = free_ports(2)
        addr = {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}
        self.hosts: dict[str, Mount] = {}
        for me, other in (("a", "b"), ("b", "a")):
            args = [
                "--node-id",
                f"{level}-{me}",
                "--listen",
                addr[me],
                "--peers",
                addr[other],
                "--token-file",
                str(token),
                "--replicas",
                "1",
                "--fsync",
                level,
                *gcs.mount_args(f"fsync-{level}", "manual"),
            ]
            self.hosts[me] = ctx.scratch.mount(f"fsync-{level}-{me}", ctx.ram_size, args)
        deadline = time.monotonic() + 30
        for m in self.hosts.values():
            while status(m)["peers"]["live_peers"] < 1:
                if time.monotonic() > deadline:
                    raise BenchError(f"{m.path}: its peer is not alive after 30 s")
                time.sleep(0.05)

    @property
    def a(self) -> Mount:
        return self.hosts["a"]

    def pids(self) -> list[int]:
        return [p for m in self.hosts.values() if m.pid is not None for p in family(m.pid)]

    def settle(self, timeout: float = 300) -> None:
        """Nothing to replicate, broadcast, upload or delete on either host."""
        deadline = time.monotonic() + timeout
        for m in self.hosts.values():
            while True:
                st = status(m)
                p, d = st["peers"], st["durable"]
                busy = (
                    p["replication_queue"],
                    p["broadcast_queue"],
                    st["open_handles"],
                    d["queued_files"],
                    d["inflight_files"],
                    d["pending_deletes"],
                )
                if not any(busy):
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"{m.path}: not settled after {timeout:.0f} s: {busy}")
                time.sleep(0.02)

    def log_lines(self) -> dict[str, list[str]]:
        """Warning and error lines of both daemons' logs (before the RAM dirs go)."""
        out: dict[str, list[str]] = {}
        for name, m in self.hosts.items():
            try:
                text = (m.ram_dir / "mtcfs.log").read_text(errors="replace")
            except OSError:
                continue
            lines = [ln for ln in text.splitlines() if any(k in ln for k in LOG_MARKS)]
            if lines:
                out[f"{self.level}-{name}"] = lines[-50:]
        return out

    def stop(self, ctx: Context) -> None:
        for m in self.hosts.values():
            if m in ctx.scratch.mounts:
                ctx.scratch.unmount(m)


# -- the workloads: (root) -> seconds --------------------------------------------


_CHUNK = bytes((i * 131 + 7) & 0xFF for i in range(MiB))  # iotool.c's pattern


def _write_fsync(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(_CHUNK)
        done = 0
        while done < size:
            done += os.write(fd, view[: min(MiB, size - done)])
        os.fsync(fd)
    finally:
        os.close(fd)


def dcp_step(root: Path, shard: int) -> float:
    """torch DCP's save on one host: shards fsync'd, then .metadata by rename."""
    t0 = time.monotonic()
    step = root / "step_1"
    step.mkdir()
    for i in range(SHARDS):
        _write_fsync(step / f"__{i}_0.distcp", shard)
    _write_fsync(step / ".metadata.tmp", METADATA_SIZE)
    os.rename(step / ".metadata.tmp", step / ".metadata")
    return time.monotonic() - t0


def _check_level(level: str, paths: list[Path]) -> None:
    """The level was reached (checked once the call returned; states only grow)."""
    for p in paths:
        st = state(p)
        if level == "replicas" and st["replicas"] < 1:
            raise BenchError(f"--fsync replicas returned without a replica: {p} {st}")
        if level == "gcs" and not st["persisted"]:
            raise BenchError(f"--fsync gcs returned before the upload: {p} {st}")


# -- the group -------------------------------------------------------------------


def group(ctx: Context) -> list[Row]:
    sc = ctx.scratch
    big = min(256 * MiB, ctx.size)
    shard = max(MiB, big // SHARDS // MiB * MiB)
    gcs = Gcs(sc.shm_dir("fsync-gcs"))
    sc.defer(gcs.close)
    token = sc.tmp / "fsync-token"
    token.write_text(secrets.token_hex(24) + "\n")
    token.chmod(0o600)
    pairs: dict[str, Pair] = {}
    details: dict[str, Any] = {
        "code": code_version(),
        "big": big,
        "shard": shard,
        "reps": ctx.reps,
        "loadavg_start": os.getloadavg()[0],
    }
    try:
        err.print(f"  fake-gcs-server at {gcs.url} (pid {gcs.pid})", style="dim")
        for level in LEVELS:
            pairs[level] = Pair(ctx, gcs, level, token)
            err.print(
                f"  --fsync {level}: hosts a (pid {pairs[level].a.pid}) and "
                f"b (pid {pairs[level].hosts['b'].pid})",
                style="dim",
            )
        pids = [p for pr in pairs.values() for p in pr.pids()] + [gcs.pid]
        ref_root = sc.shm_dir("fsync-ref")

        workloads: list[tuple[str, str, Callable[[Path], float], Callable[[Path], list[Path]]]] = [
            (
                "big",
                f"1 file of {_size(big)}, 1 MiB writes, fsync, close",
                lambda root: ctx.io.write(root / "big.bin", big, MiB, fsync=True),
                lambda root: [root / "big.bin"],
            ),
            (
                "small",
                f"{SMALL_FILES} files of 64 KiB, each fsync'd",
                lambda root: ctx.io.tree(root, 1, SMALL_FILES, SMALL_SIZE, SMALL_SIZE, fsync=True),
                lambda root: sorted((root / "d000").iterdir()),
            ),
            (
                "dcp",
                f"DCP-like step: {SHARDS} x {_size(shard)} shards fsync'd, "
                f".metadata.tmp fsync'd + renamed",
                lambda root: dcp_step(root, shard),
                lambda root: [root / "step_1" / f"__{i}_0.distcp" for i in range(SHARDS)],
            ),
        ]
        results: dict[str, dict[str, list[float]]] = {}
        for key, label, work, checked in workloads:
            err.print(f"  {label}", style="dim")
            results[key] = _measure(ctx, pairs, pids, ref_root, key, work, checked)
        details["values"] = results
        return _rows(workloads, results, big)
    finally:
        logs: dict[str, list[str]] = {}
        for pr in pairs.values():
            logs.update(pr.log_lines())
            pr.stop(ctx)
        gcs.close()
        details["log_warnings"] = logs
        details["loadavg_end"] = os.getloadavg()[0]
        with contextlib.suppress(OSError):
            save_details(DETAILS, details)


def _measure(
    ctx: Context,
    pairs: dict[str, Pair],
    pids: list[int],
    ref_root: Path,
    key: str,
    work: Callable[[Path], float],
    checked: Callable[[Path], list[Path]],
) -> dict[str, list[float]]:
    runs = 0

    def side(level: str | None) -> Callable[[], float]:
        def one() -> float:
            nonlocal runs
            runs += 1
            base = ref_root if level is None else pairs[level].a.path
            root = base / f"{key}-{runs}"
            root.mkdir()
            seconds = work(root)
            if level is not None:
                _check_level(level, checked(root))
                pairs[level].settle()  # copies and uploads done before the files go
            shutil.rmtree(root)
            if level is not None:
                pairs[level].settle()
            _quiesce(pids)
            return seconds

        return one

    names = ["tmpfs", *LEVELS]
    sides = [side(None), *(side(level) for level in LEVELS)]
    for fn in sides:  # warm-up, untimed
        fn()
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(ctx.reps):
        k = rep % len(sides)
        for i in list(range(k, len(sides))) + list(range(k)):
            out[names[i]].append(sides[i]())
        err.print(
            f"  {key}: rep {rep + 1}/{ctx.reps}: "
            + ", ".join(f"{n} {fmt(out[n][-1])} s" for n in names),
            style="dim",
        )
    return out


def _rows(
    workloads: list[tuple[str, str, Any, Any]],
    results: dict[str, dict[str, list[float]]],
    big: int,
) -> list[Row]:
    rows: list[Row] = []
    for key, label, _, _ in workloads:
        r = results[key]
        if key == "small":  # per file, in ms
            r = {n: [v * 1000 / SMALL_FILES for v in vs] for n, vs in r.items()}
            unit = "ms/file"
        else:
            unit = "s"
        for level in LEVELS:
            note = ""
            if key == "big":
                note = f"{big / MiB / median(r[level]):,.0f} MiB/s vs tmpfs " + (
                    f"{big / MiB / median(r['tmpfs']):,.0f} MiB/s"
                )
            rows.append(
                Row(
                    "fsync",
                    f"{label}: --fsync {level}",
                    unit,
                    r[level],
                    r["tmpfs"],
                    higher_is_better=False,
                    note=note,
                )
            )
        for level in LEVELS[1:]:
            rows.append(
                Row(
                    "fsync",
                    f"{label}: --fsync {level} vs local",
                    unit,
                    r[level],
                    r["local"],
                    ref_label="--fsync local",
                    higher_is_better=False,
                )
            )
    return rows
