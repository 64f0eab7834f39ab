"""The RAM-tier lifecycle under a training loop: steps, retention, eviction,
backpressure, replication and persistence, end to end.

Two mtcfs daemons on loopback, host a (the trainer's) and host b (its peer),
each `--ram-size 3 x step --replicas 1 --persist step --keep-steps N
--metrics-port P`, over one fake-gcs-server with the filesystem backend in a
directory on disk (a run writes 20 GiB: too much for the memory backend or
/dev/shm). A trainer process (this file run as a script) saves a checkpoint
step every `interval` seconds, torch DCP style: `step_<n>/` with 4 shard files
`__<i>_0.distcp` (1 MiB writes, fsync, close), then `.metadata.tmp` written,
fsynced and renamed to `.metadata` (the commit). It computes each file's
crc32c while writing and reports every step as a JSON line on stdout. A step
starts at its slot on the clock (t0 + n x interval), or at once when the
previous save overran it (the training loop blocks on its save).

Measured, per run:
- save time of each step (mkdir to the rename of `.metadata`), median and worst;
- for each shard, close() returned -> replicated on b and -> persisted, from a
  poller thread that reads `user.mtcfs.state` on host a every 20 ms (replicated:
  b among `holders`); the daemons' own lag histograms (Prometheus) beside them;
- commit (rename of `.metadata`) -> marker persisted: the step is in GCS;
- at the end, after every upload: each step read back through host a (old
  steps were evicted, so they come back from GCS or b) and every object's
  crc32c in the bucket, against the crcs the trainer computed; the newest step
  also read on host b. A step is lost if any of its files cannot be read back
  on a or differs, or its save failed; it is "not complete in GCS" if any of
  its objects is missing or differs once the uploads have stopped (every file
  persisted, or nothing persisted for 30 s and no upload in flight);
- failed writes (any OSError in the trainer), and from /metrics on both hosts:
  mtcfs_evictions_total, mtcfs_enospc_total, mtcfs_space_wait_seconds_total,
  the lag histograms' counts and sums.

Runs: "steady" (--steps steps, keep 1, an interval at which the measured GCS
upload speed keeps up), "keep2" (half as many steps, --keep-steps 2: 2 kept
steps + the one being written fill the RAM tier exactly) and "burst" (30% of
the steps, keep 1, one step per 2 s per GiB: faster than the bucket absorbs,
so writers wait for uploads to make room).

References in the same run: the same save loop into a plain /dev/shm
directory (the trainer deleting the previous step after each commit), and
google-cloud-storage's Blob.upload_from_filename of one step's bytes to the
same server, which says whether persistence can keep up with the interval.

Details (every step, every lag, metrics, `mtcfs steps --json`) go to
bench/results/lifecycle.json, the daemons' logs to
bench/results/lifecycle-logs/. Everything started here is stopped after an
error or Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    BenchError,
    Context,
    GiB,
    MiB,
    Mount,
    Row,
    code_version,
    err,
    fmt,
    median,
    mib_s,
    run,
    save_details,
)
from durable import BUCKET, Gcs
from lifecycle_trainer import MARKER, SHARDS
from peers import free_ports
from ramtier import _size

from mtcfs import control

STATE = "user.mtcfs.state"
POLL = 0.02
DETAILS = BENCH_DIR / "results" / "lifecycle.json"
LOGS = BENCH_DIR / "results" / "lifecycle-logs"
BURST_PER_GIB = 2.0  # burst run: one step every 2 s per GiB of step
STALL = 30  # seconds without a file getting replicated or persisted: stop waiting


def status(m: Mount) -> dict[str, Any]:
    """`mtcfs status --json` without the CLI's start-up."""
    return control.request(str(m.path), "status")["status"]


def scrape(port: int) -> dict[str, float]:
    """/metrics of a daemon: sample name{labels} -> value (and name -> sum over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
            if labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@dataclass
class Shard:
    rel: str
    size: int
    crc: int
    closed: float
    replicated: float | None = None
    persisted: float | None = None
    skipped: bool = False  # never replicated: persisted and evicted first


class Poller(threading.Thread):
    """Reads user.mtcfs.state of each new file on host a every POLL s, and records
    when b first shows among its holders and when it is first persisted."""

    def __init__(self, root: Path, peer_id: str) -> None:
        super().__init__(name="lifecycle-poller", daemon=True)
        self.root = root
        self.peer_id = peer_id
        self.pending: list[Shard] = []
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.errors: list[str] = []
        self.progress = time.monotonic()  # when a file last became replicated or persisted

    def add(self, s: Shard) -> None:
        with self.lock:
            self.pending.append(s)
            self.progress = time.monotonic()

    def outstanding(self) -> int:
        with self.lock:
            return len(self.pending)

    def run(self) -> None:
        while not self.stop_flag.is_set():
            with self.lock:
                todo = list(self.pending)
            for s in todo:
                try:
                    st = json.loads(os.getxattr(self.root / s.rel, STATE))
                except OSError as e:
                    self.errors.append(f"{s.rel}: {e}")
                    continue
                now = time.monotonic()
                if s.replicated is None and self.peer_id in st.get("holders", []):
                    s.replicated = self.progress = now
                if s.persisted is None and st.get("persisted"):
                    s.persisted = self.progress = now
                if s.replicated is None and s.persisted is not None and "ram" not in st["tiers"]:
                    # Persisted and evicted before its replica was made: GCS holds
                    # it, no replica will follow.
                    s.skipped = True
                if s.persisted is not None and (s.replicated is not None or s.skipped):
                    with self.lock:
                        self.pending.remove(s)
            self.stop_flag.wait(POLL)


@dataclass
class Outcome:
    """One training run: what the trainer reported, what the poller saw, the checks."""

    name: str
    steps: int
    step_size: int
    interval: float
    keep: int
    records: list[dict[str, Any]] = field(default_factory=list)
    shards: list[Shard] = field(default_factory=list)
    markers: list[Shard] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def saves(self) -> list[float]:
        return [r["end"] - r["start"] for r in self.records if not r["errors"]]

    @property
    def failed_writes(self) -> int:
        return sum(len(r["errors"]) for r in self.records)

    def lags(self, what: str) -> list[float]:
        return [getattr(s, what) - s.closed for s in self.shards if getattr(s, what) is not None]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps": self.steps,
            "step_size": self.step_size,
            "interval": self.interval,
            "keep_steps": self.keep,
            "saves": self.saves,
            "failed_writes": self.failed_writes,
            "records": [
                {k: v for k, v in r.items() if k != "files"} | {"files": len(r["files"])}
                for r in self.records
            ],
            "lags": [
                {
                    "rel": s.rel,
                    "replicated": _lag(s, "replicated"),
                    "persisted": _lag(s, "persisted"),
                    "replication_skipped": s.skipped,
                }
                for s in self.shards + self.markers
            ],
            "metrics": self.metrics,
            "checks": self.checks,
            **self.extra,
        }


def _lag(s: Shard, what: str) -> float | None:
    t = getattr(s, what)
    return None if t is None else round(t - s.closed, 3)


def start_trainer(
    root: Path, steps: int, size: int, interval: float, keep: int
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(BENCH_DIR / "lifecycle_trainer.py"),
            str(root),
            str(steps),
            str(size),
            str(interval),
            str(keep),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        proc.kill()
        raise BenchError(f"the trainer did not start: {line!r}")
    return proc


def drive_trainer(
    proc: subprocess.Popen, on_step: Any, label: str, total: int
) -> list[dict[str, Any]]:
    """Let the trainer go; hand each step's record to on_step as it arrives."""
    assert proc.stdin is not None and proc.stdout is not None
    records = []
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        for line in proc.stdout:
            rec = json.loads(line)
            records.append(rec)
            on_step(rec)
            save = rec["end"] - rec["start"]
            late = rec["start"] - rec["due"]
            err.print(
                f"  {label}: step {rec['step'] + 1}/{total}: saved in {fmt(save)} s"
                + (f" (started {fmt(late)} s late)" if late > 0.05 else "")
                + (f" [red]FAILED: {rec['errors']}[/]" if rec["errors"] else ""),
                style="dim",
            )
        if proc.wait(timeout=60) != 0:
            raise BenchError(f"the trainer exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return records


# -- the group -----------------------------------------------------------------------------


def group(ctx: Context) -> list[Row]:
    sc = ctx.scratch
    size = ctx.size
    if size % (SHARDS * MiB):
        raise BenchError(f"lifecycle: --size must be a multiple of {SHARDS} MiB")
    steps = ctx.steps
    workdir = Path(tempfile.mkdtemp(prefix="mtcfs-bench-gcs-", dir="/var/tmp"))
    sc.defer(lambda: shutil.rmtree(workdir, ignore_errors=True))
    gcs = Gcs(workdir)  # the filesystem backend, on disk
    sc.defer(gcs.close)
    details: dict[str, Any] = {
        "size": size,
        "steps": steps,
        "reps": ctx.reps,
        "code": code_version(),
        "gcs_workdir": str(workdir),
    }
    rows: list[Row] = []
    try:
        err.print(
            f"  fake-gcs-server (filesystem backend in {workdir}) at {gcs.url} (pid {gcs.pid})",
            style="dim",
        )
        up, up_chunked = upload_reference(ctx, gcs)
        details["upload_mib_s"] = {"one_request": up, "chunked": up_chunked}
        interval = ctx.step_interval or choose_interval(size, median(up))
        details["interval"] = interval
        err.print(
            f"  google-cloud-storage upload of {_size(size)}: {fmt(median(up))} MiB/s "
            f"-> one step every {interval:g} s",
            style="dim",
        )
        ref = tmpfs_reference(ctx, steps, min(interval, 1.0))
        details["tmpfs_saves"] = ref
        runs: list[dict[str, Any]] = []
        details["runs"] = runs  # each run's details, also those of a run that failed
        steady = training_run(ctx, gcs, runs, "steady", steps, interval, keep=1)
        keep2 = training_run(ctx, gcs, runs, "keep2", max(3, steps // 2), interval, keep=2)
        burst_interval = max(0.25, round(BURST_PER_GIB * size / GiB, 2))
        burst = training_run(
            ctx, gcs, runs, "burst", max(3, steps * 3 // 10), burst_interval, keep=1
        )
        rows += steady_rows(steady, ref, up, up_chunked, interval)
        rows += keep2_rows(keep2, ref)
        rows += burst_rows(burst, up)
    finally:
        gcs.close()
        shutil.rmtree(workdir, ignore_errors=True)
        save_details(DETAILS, details)
    return rows


def choose_interval(size: int, upload_mib_s: float) -> float:
    """Seconds per step such that one step's upload takes at most ~2/3 of it: the
    daemon's upload shares 2 cores with the trainer and replication."""
    return float(max(2, math.ceil(1.5 * size / MiB / upload_mib_s)))


def upload_reference(ctx: Context, gcs: Gcs) -> tuple[list[float], list[float]]:
    """MiB/s of Blob.upload_from_filename of one step's bytes from /dev/shm to the
    same server: in one request (blob.chunk_size = size, as mtcfs sends a file),
    and with the library's default 100 MiB chunks (for context)."""
    src = ctx.ref_dir() / "lifecycle-upload-src"
    ctx.io.write(src, ctx.size, MiB, fsync=True)
    one: list[float] = []
    chunked: list[float] = []
    try:
        for i in range(ctx.reps):
            for out, whole in ((one, True), (chunked, False)):
                blob = gcs.bucket.blob(f"ref/up-{i}.bin")
                if whole:
                    blob.chunk_size = ctx.size  # a multiple of 256 KiB
                t0 = time.monotonic()
                blob.upload_from_filename(str(src))
                out.append(mib_s(ctx.size, time.monotonic() - t0))
                blob.delete()
            err.print(
                f"  upload reference: rep {i + 1}/{ctx.reps}: {fmt(one[-1])} MiB/s in one "
                f"request, {fmt(chunked[-1])} MiB/s in 100 MiB chunks",
                style="dim",
            )
    finally:
        src.unlink(missing_ok=True)
    return one, chunked


def tmpfs_reference(ctx: Context, steps: int, interval: float) -> list[float]:
    """The same save loop into a /dev/shm directory; save seconds per step."""
    root = ctx.scratch.shm_dir("lifecycle-tmpfs")
    try:
        proc = start_trainer(root, steps, ctx.size, interval, keep=1)
        records = drive_trainer(proc, lambda rec: None, "tmpfs", steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bad = [r for r in records if r["errors"]]
    if bad:
        raise BenchError(f"the tmpfs reference failed: {bad[0]['errors']}")
    return [r["end"] - r["start"] for r in records]


def start_hosts(ctx: Context, gcs: Gcs, name: str, keep: int) -> tuple[Mount, Mount, list[int]]:
    """Hosts a and b of one run: their own bucket prefix, fresh RAM dirs."""
    sc = ctx.scratch
    token = sc.tmp / "lifecycle-token"
    if not token.exists():
        token.write_text(os.urandom(24).hex() + "\n")
        token.chmod(0o600)
    p_a, p_b, m_a, m_b = free_ports(4)
    ram = _size(3 * ctx.size).replace(" ", "")
    mounts = []
    for host, listen, peer, mport in (("a", p_a, p_b, m_a), ("b", p_b, p_a, m_b)):
        args = [
            "--node-id",
            host,
            "--listen",
            f"127.0.0.1:{listen}",
            "--peers",
            f"127.0.0.1:{peer}",
            "--token-file",
            str(token),
            "--replicas",
            "1",
            *gcs.mount_args(f"lc-{name}", "step"),
            "--keep-steps",
            str(keep),
            "--metrics-port",
            str(mport),
            "--metrics-address",
            "127.0.0.1",
        ]
        mounts.append(sc.mount(f"lc-{name}-{host}", ram, args))
    a, b = mounts
    deadline = time.monotonic() + 30
    while not all(status(m)["peers"]["live_peers"] >= 1 for m in (a, b)):
        if time.monotonic() > deadline:
            raise BenchError(f"lifecycle {name}: hosts a and b do not see each other")
        time.sleep(0.05)
    return a, b, [m_a, m_b]


def training_run(
    ctx: Context,
    gcs: Gcs,
    runs: list[dict[str, Any]],
    name: str,
    steps: int,
    interval: float,
    keep: int,
) -> Outcome:
    size = ctx.size
    out = Outcome(name, steps, size, interval, keep)
    err.print(
        f"  run {name}: {steps} steps of {_size(size)}, one per {interval:g} s, "
        f"--keep-steps {keep}, --ram-size {_size(3 * size)} on hosts a and b",
        style="dim",
    )
    a, b, ports = start_hosts(ctx, gcs, name, keep)
    poller = Poller(a.path, "b")
    try:
        proc = start_trainer(a.path, steps, size, interval, keep=0)
        poller.start()
        t_run = time.monotonic()

        def on_step(rec: dict[str, Any]) -> None:
            for f in rec["files"]:
                s = Shard(f["rel"], f["size"], f["crc"], f["closed"])
                (out.markers if f["rel"].endswith(MARKER) else out.shards).append(s)
                poller.add(s)

        out.records = drive_trainer(proc, on_step, name, steps)
        out.extra["trainer_seconds"] = time.monotonic() - t_run
        # Every file replicated and persisted (the poller sees it), then the queues empty.
        deadline = time.monotonic() + 120 + steps * size / (20 * MiB)
        while poller.outstanding():
            stalled = time.monotonic() - poller.progress > STALL and not uploading(a)
            if stalled or time.monotonic() > deadline:
                with poller.lock:
                    unsafe = [s.rel for s in poller.pending]
                out.checks["never_safe"] = unsafe
                why = f"no progress for {STALL} s" if stalled else "timed out"
                err.print(
                    f"[red]  run {name}: {len(unsafe)} files not replicated and persisted "
                    f"({why}): "
                    f"{', '.join(unsafe[:8])}[/]"
                )
                break
            time.sleep(0.1)
        out.extra["all_safe_after_s"] = time.monotonic() - t_run
        poller.stop_flag.set()
        poller.join()
        out.extra["poller_errors"] = poller.errors[:20]
        out.extra["status_a_before_check"] = status(a)
        out.metrics["a"] = scrape(ports[0])
        out.metrics["b"] = scrape(ports[1])
        out.extra["steps_a"] = json.loads(
            run([sys.executable, "-m", "mtcfs", "steps", str(a.path), "--json"]).stdout
        )
        verify(out, gcs, a, b)
        out.metrics["a_after_check"] = scrape(ports[0])
        out.metrics["b_after_check"] = scrape(ports[1])
        out.extra["status_a"] = status(a)
        out.extra["status_b"] = status(b)
    finally:
        poller.stop_flag.set()
        with contextlib.suppress(Exception):
            runs.append(out.to_json())
        keep_logs(name, a, b)
        for m in (a, b):
            ctx.scratch.unmount(m)
        delete_prefix(gcs, f"lc-{name}/")
    saves = out.saves or [math.inf]
    err.print(
        f"  run {name}: saves median {fmt(median(saves))} s, worst {fmt(max(saves))} s; "
        f"lost steps {out.checks['lost_steps']}, failed writes {out.failed_writes}",
        style="dim",
    )
    return out


def uploading(m: Mount) -> bool:
    d = status(m).get("durable") or {}
    return bool(d.get("inflight_files"))


def verify(out: Outcome, gcs: Gcs, a: Mount, b: Mount) -> None:
    """Every step back through host a (oldest first: evicted, read through) and in
    the bucket, against the trainer's crcs; the newest step also on host b."""
    import google_crc32c

    def read_crc(path: Path) -> tuple[int, int]:
        crc, n = 0, 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(MiB):
                crc = google_crc32c.extend(crc, chunk)
                n += len(chunk)
        return crc, n

    files = {s.rel: s for s in out.shards + out.markers}
    bad: dict[str, str] = {}
    lost: set[int] = {r["step"] for r in out.records if r["errors"]}
    not_in_gcs: set[int] = set(lost)
    rt0 = _fetched(a)
    t0 = time.monotonic()
    nbytes = 0
    for r in out.records:
        for f in r["files"]:
            s = files[f["rel"]]
            try:
                crc, n = read_crc(a.path / s.rel)
                nbytes += n
                if (crc, n) != (s.crc, s.size):
                    bad[f"a:{s.rel}"] = (
                        f"read {n} bytes crc {crc:#x}, wrote {s.size} crc {s.crc:#x}"
                    )
            except OSError as e:
                bad[f"a:{s.rel}"] = str(e)
            if f"a:{s.rel}" in bad:
                lost.add(r["step"])
            blob = gcs.bucket.get_blob(f"lc-{out.name}/{s.rel}")
            want = _b64crc(s.crc)
            if blob is None or blob.crc32c != want or blob.size != s.size:
                bad[f"gcs:{s.rel}"] = (
                    "missing" if blob is None else f"size {blob.size} crc32c {blob.crc32c}"
                )
                not_in_gcs.add(r["step"])
    read_s = time.monotonic() - t0
    newest = max((r for r in out.records if not r["errors"]), key=lambda r: r["step"], default=None)
    if newest is not None:
        for f in newest["files"]:
            s = files[f["rel"]]
            try:
                if read_crc(b.path / s.rel) != (s.crc, s.size):
                    bad[f"b:{s.rel}"] = "crc or size differs"
            except OSError as e:
                bad[f"b:{s.rel}"] = str(e)
            if f"b:{s.rel}" in bad:
                lost.add(newest["step"])
    out.checks |= {
        "lost_steps": len(lost),
        "lost": sorted(lost),
        "steps_not_in_gcs": sorted(not_in_gcs),
        "bad_files": bad,
        "read_back_mib_s": mib_s(nbytes, read_s) if read_s > 0 else None,
        "read_back_bytes": nbytes,
        "fetched_by_source": _diff(_fetched(a), rt0),
    }
    if bad:
        err.print(f"[red]  run {out.name}: bad files: {dict(list(bad.items())[:5])}[/]")


def _fetched(m: Mount) -> dict[str, int]:
    """Bytes the mount read through, by source (peer address or bucket URL)."""
    rt = (status(m).get("durable") or {}).get("readthrough") or {}
    return dict(rt.get("bytes_by_source", {}))


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _b64crc(crc: int) -> str:
    import base64

    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def keep_logs(name: str, *mounts: Mount) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    for m, host in zip(mounts, "ab", strict=False):
        with contextlib.suppress(OSError):
            shutil.copyfile(m.ram_dir / "mtcfs.log", LOGS / f"{name}-{host}.log")


def delete_prefix(gcs: Gcs, prefix: str) -> None:
    """Free the disk of a finished run (the server keeps objects in files)."""
    with contextlib.suppress(Exception):
        for blob in gcs.client.list_blobs(BUCKET, prefix=prefix):
            blob.delete()


# -- rows ----------------------------------------------------------------------------------


def _m(o: Outcome, host: str, name: str) -> float:
    return o.metrics.get(host, {}).get(name, 0.0)


def _hist(o: Outcome, host: str, base: str) -> str:
    n = _m(o, host, f"{base}_count")
    s = _m(o, host, f"{base}_sum")
    return f"{n:.0f} obs, mean {fmt(s / n) if n else '—'} s"


def _counts(o: Outcome) -> str:
    return (
        f"evictions a/b {_m(o, 'a', 'mtcfs_evictions_total'):.0f}/"
        f"{_m(o, 'b', 'mtcfs_evictions_total'):.0f}, ENOSPC a/b "
        f"{_m(o, 'a', 'mtcfs_enospc_total'):.0f}/{_m(o, 'b', 'mtcfs_enospc_total'):.0f}, "
        f"space wait a {fmt(_m(o, 'a', 'mtcfs_space_wait_seconds_total'))} s"
    )


def _tail(values: list[float]) -> str:
    return f"worst {fmt(max(values))} s" if values else "none"


def steady_rows(
    o: Outcome, ref: list[float], up: list[float], up_chunked: list[float], interval: float
) -> list[Row]:
    g, size = "lifecycle", o.step_size
    step = f"{_size(size)} step ({SHARDS} shards, 1 MiB writes, fsync; .metadata rename)"
    what = f"{o.steps} steps, 1 per {interval:g} s, keep 1"
    rep, per = o.lags("replicated"), o.lags("persisted")
    commit = [m.persisted - m.closed for m in o.markers if m.persisted is not None]
    half = len(per) // 2
    trend = (
        f"first half median {fmt(median(per[:half]))} s, second half {fmt(median(per[half:]))} s"
        if half
        else ""
    )
    return [
        Row(
            g,
            f"save of a {step}, median: {what}",
            "s",
            o.saves,
            ref,
            higher_is_better=False,
            note=f"reference: the same loop into /dev/shm ({len(ref)} steps, "
            "previous step deleted after each commit)",
        ),
        Row(
            g,
            "save, worst step",
            "s",
            [max(o.saves)] if o.saves else [0.0],
            [max(ref)],
            higher_is_better=False,
        ),
        Row(
            g,
            "shard close() -> replicated on b (K=1), median",
            "s",
            rep or [math.inf],
            note=f"{len(rep)}/{len(o.shards)} shards ({sum(s.skipped for s in o.shards)} "
            f"persisted and evicted before a replica), {_tail(rep)}; daemon histogram a: "
            f"{_hist(o, 'a', 'mtcfs_replication_lag_seconds')}",
        ),
        Row(
            g,
            "shard close() -> persisted in GCS, median",
            "s",
            per or [math.inf],
            note=f"{len(per)}/{len(o.shards)} shards, {_tail(per)}; {trend}; daemon histogram "
            f"a: {_hist(o, 'a', 'mtcfs_persist_lag_seconds')}",
        ),
        Row(
            g,
            "step commit (.metadata rename) -> marker persisted, median",
            "s",
            commit or [math.inf],
            note=f"{_tail(commit)}: the step complete in GCS",
        ),
        Row(
            g,
            f"durable throughput needed ({_size(size)} per {interval:g} s) vs upload",
            "MiB/s",
            [mib_s(size, interval)],
            up,
            ref_label="gcs-python",
            compare=False,
            note=f"reference: Blob.upload_from_filename of {_size(size)} in one request, same "
            f"server (in 100 MiB chunks: {fmt(median(up_chunked))} MiB/s); headroom "
            f"{median(up) / mib_s(size, interval):.1f}x",
        ),
        Row(
            g,
            "persist rate of a step: first shard closed -> last shard persisted",
            "MiB/s",
            step_rates(o) or [0.0],
            up,
            ref_label="gcs-python",
            note="the step's shard bytes over that span (uploads overlap the save; 4 at a "
            "time); reference: one request per step's bytes",
        ),
        *outcome_rows(o, "steady"),
    ]


def step_rates(o: Outcome) -> list[float]:
    by_step: dict[str, list[Shard]] = {}
    for s in o.shards:
        by_step.setdefault(s.rel.split("/")[0], []).append(s)
    out = []
    for shards in by_step.values():
        if all(s.persisted is not None for s in shards):
            span = max(s.persisted for s in shards if s.persisted) - min(s.closed for s in shards)
            out.append(mib_s(sum(s.size for s in shards), span))
    return out


def outcome_rows(o: Outcome, label: str) -> list[Row]:
    g = "lifecycle"
    ev = _m(o, "a", "mtcfs_evictions_total") + _m(o, "b", "mtcfs_evictions_total")
    enospc = _m(o, "a", "mtcfs_enospc_total") + _m(o, "b", "mtcfs_enospc_total")
    rb = o.checks.get("read_back_mib_s")
    return [
        Row(g, f"{label}: evictions (a + b)", "", [ev], note=_counts(o)),
        Row(g, f"{label}: ENOSPC (a + b)", "", [enospc], max_value=1),
        Row(
            g,
            f"{label}: steps lost",
            "",
            [float(o.checks.get("lost_steps", o.steps))],
            max_value=1,
            note=f"every file read back on a ({fmt(rb) if rb else '?'} MiB/s, fetched "
            f"{o.checks.get('fetched_by_source')}) and checked in GCS by crc32c",
        ),
        Row(
            g,
            f"{label}: steps not complete in GCS",
            "",
            [float(len(o.checks.get("steps_not_in_gcs", range(o.steps))))],
            max_value=1,
            note=f"steps {o.checks.get('steps_not_in_gcs')}; files never persisted: "
            f"{len(o.checks.get('never_safe', []))} "
            f"{', '.join(o.checks.get('never_safe', [])[:6])}",
        ),
        Row(g, f"{label}: failed writes", "", [float(o.failed_writes)], max_value=1),
    ]


def keep2_rows(o: Outcome, ref: list[float]) -> list[Row]:
    g = "lifecycle"
    per = o.lags("persisted")
    return [
        Row(
            g,
            f"keep2: save, median ({o.steps} steps, 1 per {o.interval:g} s, --keep-steps 2)",
            "s",
            o.saves or [math.inf],
            ref,
            higher_is_better=False,
            note=f"worst {fmt(max(o.saves)) if o.saves else '—'} s; close -> persisted median "
            f"{fmt(median(per)) if per else '—'} s, {_tail(per)}",
        ),
        *outcome_rows(o, "keep2"),
    ]


def burst_rows(o: Outcome, up: list[float]) -> list[Row]:
    g = "lifecycle"
    per = o.lags("persisted")
    wait = _m(o, "a", "mtcfs_space_wait_seconds_total")
    return [
        Row(
            g,
            f"burst: save, worst ({o.steps} steps, 1 per {o.interval:g} s, keep 1)",
            "s",
            [max(o.saves)] if o.saves else [math.inf],
            note=f"median {fmt(median(o.saves)) if o.saves else '—'} s; needs "
            f"{fmt(mib_s(o.step_size, o.interval))} MiB/s to GCS, upload reference "
            f"{fmt(median(up))} MiB/s",
        ),
        Row(
            g,
            "burst: writers' wait for space (mtcfs_space_wait_seconds, a)",
            "s",
            [wait],
            note=f"close -> persisted median {fmt(median(per)) if per else '—'} s, {_tail(per)}",
        ),
        *outcome_rows(o, "burst"),
    ]
