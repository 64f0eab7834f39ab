"""What the commit rule costs: fsync, a directory fsync and a commit (a marker
renamed into place) return once every live peer has applied them. Per call, on
two peered daemons on loopback (`--fsync local`, so only the visibility wait is
added), beside the same calls on one daemon without peers (nothing to wait for)
and on raw tmpfs, in one run, alternating.

Each call is timed alone on host a, 200 times per rep after its file's data is
written (64 KiB, untimed):

- `fsync(fd)` of a 64 KiB file just written;
- `fsync` of its directory;
- `rename("commit_success.txt.tmp", "commit_success.txt")` in a step directory:
  the commit of a step.

Host b checks, after each rep, that it sees every file and marker (the wait is
what makes that true the moment the call returns; tests/test_visibility.py
asserts it). Medians of the per-call latencies; the round trip is the
difference between the two mtcfs rows.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from common import BenchError, Context, KiB, Row, err, median
from peers import free_ports

CALLS = 200
SIZE = 64 * KiB


def group(ctx: Context) -> list[Row]:
    token = ctx.scratch.shm_dir("commit-token") / "token"
    token.write_text(secrets.token_hex(32))
    pa, pb = free_ports(2)
    common = ["--token-file", str(token), "--replicas", "1"]
    a = ctx.scratch.mount("commit-a", "1GiB", ["--node-id", "commit-a",
                                               "--listen", f"127.0.0.1:{pa}",
                                               "--peers", f"127.0.0.1:{pb}", *common])
    b = ctx.scratch.mount("commit-b", "1GiB", ["--node-id", "commit-b",
                                               "--listen", f"127.0.0.1:{pb}",
                                               "--peers", f"127.0.0.1:{pa}", *common])
    solo = ctx.scratch.mount("commit-solo", "1GiB")
    ref = ctx.ref_dir()
    targets = {"peers": a.path, "solo": solo.path, "tmpfs": ref}
    seq = iter(range(1 << 30))
    data = os.urandom(SIZE)

    def run(root: Path) -> tuple[list[float], list[float], list[float]]:
        d = root / f"step_{next(seq)}"
        d.mkdir()
        fsyncs, dirsyncs, commits = [], [], []
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(CALLS):
                fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                    t0 = time.perf_counter()
                    os.fsync(fd)
                    fsyncs.append(time.perf_counter() - t0)
                finally:
                    os.close(fd)
                t0 = time.perf_counter()
                os.fsync(dfd)
                dirsyncs.append(time.perf_counter() - t0)
            for i in range(CALLS):
                sub = d / f"s{i}"
                sub.mkdir()
                (sub / "commit_success.txt.tmp").write_bytes(b"ok")
                t0 = time.perf_counter()
                os.rename(sub / "commit_success.txt.tmp", sub / "commit_success.txt")
                commits.append(time.perf_counter() - t0)
        finally:
            os.close(dfd)
        if root == a.path:
            seen = b.path / d.name
            missing = [n for n in (*(f"f{i}" for i in range(CALLS)),
                                   *(f"s{i}/commit_success.txt" for i in range(CALLS)))
                       if not (seen / n).exists()]
            if missing:
                raise BenchError(f"host b misses {len(missing)} of the names a committed, "
                                 f"e.g. {missing[:3]}")
        return fsyncs, dirsyncs, commits

    results: dict[str, list[tuple[float, float, float]]] = {t: [] for t in targets}
    names = list(targets)
    for t in names:
        run(targets[t])  # warm-up
    for rep in range(ctx.reps):
        order = names[rep % 3:] + names[:rep % 3]
        for t in order:
            f, ds, c = run(targets[t])
            results[t].append((median(f), median(ds), median(c)))
        err.print(f"  commit rep {rep + 1}/{ctx.reps}: " + ", ".join(
            f"{t} fsync {results[t][-1][0] * 1e3:.2f} ms, commit {results[t][-1][2] * 1e3:.2f} ms"
            for t in names), style="dim")

    rows = []
    for i, what in enumerate(("fsync of a 64 KiB file", "fsync of its directory",
                              "commit: rename of commit_success.txt into place")):
        ms = {t: [r[i] * 1e3 for r in results[t]] for t in names}
        rows.append(Row("commit", f"{what}: 2 peered hosts vs 1 host", "ms", ms["peers"],
                        ms["solo"], ref_label="1 host, no peers", higher_is_better=False,
                        note=f"round trip {median(ms['peers']) - median(ms['solo']):.2f} ms"))
        rows.append(Row("commit", f"{what}: 2 peered hosts vs tmpfs", "ms", ms["peers"],
                        ms["tmpfs"], higher_is_better=False))
    return rows
