"""The durable tier (GCS) beside its references, all on one local GCS server.

One fake-gcs-server (tests/support/gcs_server.py, filesystem backend with its root in
/dev/shm, so no disk is involved) serves both sides of every comparison:

1. upload of a closed file: mtcfs (`--persist manual`), timed from the persist
   request on the control socket to the daemon reporting the file persisted
   (GCS confirmed size and crc32c), vs google-cloud-storage's
   Blob.upload_from_filename of the same bytes from tmpfs (its defaults, and,
   for context, in one request);
2. read-through: a fresh mount with an empty RAM dir over a prefix that holds
   only the file, read whole with the C reader (cold), vs
   Blob.download_to_filename into /dev/shm;
3. the trainer's write throughput (C writer, 1 MiB writes) on an `on-close`
   mount while another file is uploading, vs the same write with the durable
   tier idle;
4. a checkpoint written through `rclone mount --vfs-cache-mode writes` vs mtcfs
   (`--persist on-close`): time until close() returns, and until the object is
   complete in GCS (polled with the plain client).

Everything started here (the server, mounts, rclone) is also registered with
Scratch.defer, so it is stopped after an error or Ctrl-C too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    BenchError,
    Context,
    MiB,
    Mount,
    Row,
    alternating_pair,
    cpu_seconds,
    drop_caches,
    err,
    fmt,
    force_unmount,
    median,
    mib_s,
)
from ramtier import _size

from mtcfs import control
from mtcfs.config import mount_entry

from support.gcs_server import GcsServer

BUCKET = "mtcfs-bench"
POLL = 0.025  # seconds between progress polls
RCLONE_REMOTE = "benchgcs"



class Gcs:
    """The local GCS server, and google-cloud-storage's client on it."""

    def __init__(self, workdir: Path) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.server = GcsServer("filesystem", workdir=workdir)
        self.server.start()
        self.server.create_bucket(BUCKET)
        self.url = self.server.url
        self.client = storage.Client(
            project="mtcfs-bench",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.url},
        )
        self.bucket = self.client.bucket(BUCKET)

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def mount_args(self, prefix: str, persist: str) -> list[str]:
        return [
            "--bucket",
            f"gs://{BUCKET}/{prefix}",
            "--gcs-endpoint",
            self.url,
            "--persist",
            persist,
        ]

    def size_of(self, key: str) -> int | None:
        blob = self.bucket.get_blob(key)
        return None if blob is None else int(blob.size or 0)

    def wait_object(self, key: str, size: int, timeout: float = 600) -> float:
        """Poll until `key` exists with `size` bytes; returns time.monotonic() then."""
        deadline = time.monotonic() + timeout
        while True:
            if self.size_of(key) == size:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise BenchError(f"gs://{BUCKET}/{key} not complete after {timeout:.0f} s")
            time.sleep(POLL)

    def wait_gone(self, key: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.size_of(key) is not None:
            if time.monotonic() > deadline:
                raise BenchError(f"gs://{BUCKET}/{key} still there after {timeout:.0f} s")
            time.sleep(POLL)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.server.stop()


class Rclone:
    """`rclone mount --vfs-cache-mode writes` of gs://BUCKET/PREFIX, configured
    by environment variables only (anonymous, --gcs-endpoint on the local server),
    its VFS cache under /dev/shm like the mtcfs RAM tier."""

    def __init__(self, gcs: Gcs, prefix: str, mountpoint: Path, work: Path) -> None:
        self.mountpoint = mountpoint
        self.log = work / "rclone.log"
        conf = work / "rclone.conf"
        conf.touch()
        up = RCLONE_REMOTE.upper()
        env = {
            **os.environ,
            "RCLONE_CONFIG": str(conf),  # empty: nothing is read from or written to ~/.config
            f"RCLONE_CONFIG_{up}_TYPE": "google cloud storage",
            f"RCLONE_CONFIG_{up}_ANONYMOUS": "true",
            f"RCLONE_CONFIG_{up}_ENDPOINT": f"{gcs.url}/storage/v1/",
        }
        rclone = shutil.which("rclone")
        if rclone is None:
            raise BenchError("rclone is needed for the durable group (apt-get install rclone)")
        self.version = subprocess.run(
            [rclone, "version"], capture_output=True, text=True
        ).stdout.split("\n", 1)[0]
        self.args = [
            rclone,
            "mount",
            f"{RCLONE_REMOTE}:{BUCKET}/{prefix}",
            str(mountpoint),
            "--vfs-cache-mode",
            "writes",
            "--cache-dir",
            str(work / "cache"),
            # Upload as soon as a file is closed (rclone's default waits 5 s).
            "--vfs-write-back",
            "0s",
            "--log-file",
            str(self.log),
            "-v",
        ]
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            self.args, env=env, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while mount_entry(str(mountpoint)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"rclone mount failed: {self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """fusermount3 -u, wait for rclone to exit; then -uz and a kill if needed."""
        if mount_entry(str(self.mountpoint)) is not None:
            subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                err.print(f"[yellow]rclone {self.proc.pid} still running: killing it[/]")
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        force_unmount(self.mountpoint)


def _quiesce(pids: list[int], window: float = 0.3, timeout: float = 30) -> None:
    """Wait until these processes (the server, daemons, rclone) have stopped
    working off the previous run: < 10% of a CPU over `window` seconds. Go's
    garbage collector returns the server's memory for a few seconds after a
    1 GiB upload, which would otherwise land on the next timed run."""

    def used() -> float:
        total = 0.0
        for p in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += cpu_seconds(p)
        return total

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = used()
        time.sleep(window)
        if used() - before < 0.1 * window:
            return


def _settle(m: Mount, timeout: float = 300) -> dict[str, Any]:
    """Wait until the mount's uploader has nothing queued, in flight or to delete."""
    deadline = time.monotonic() + timeout
    while True:
        d = m.durable()
        if not (d["queued_files"] or d["inflight_files"] or d["pending_deletes"]):
            return d
        if time.monotonic() > deadline:
            raise BenchError(f"{m.path}: uploads not finished after {timeout:.0f} s: {d}")
        time.sleep(POLL)


def persist_and_wait(m: Mount, rel: str, timeout: float = 600) -> None:
    """`mtcfs persist MP REL --wait`, without the CLI's start-up: the persist
    request, then persist_progress polled until GCS has confirmed the file."""
    mp = str(m.path)
    r = control.request(mp, "persist", paths=[rel])
    if r["files"] != 1:
        raise BenchError(f"mtcfs persist {rel}: queued {r['files']} files, expected 1")
    deadline = time.monotonic() + timeout
    while True:
        st = control.request(mp, "persist_progress", inos=r["inos"])
        if st["failed"]:
            raise BenchError(f"mtcfs persist {rel} failed: {st['failed']}")
        if st["finished"]:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"mtcfs persist {rel}: not done after {timeout:.0f} s: {st}")
        time.sleep(POLL)


def group(ctx: Context) -> list[Row]:
    sc = ctx.scratch
    gcs = Gcs(sc.shm_dir("gcs"))
    sc.defer(gcs.close)
    try:
        err.print(f"  fake-gcs-server at {gcs.url} (pid {gcs.pid}), bucket {BUCKET}", style="dim")
        rows = upload(ctx, gcs)
        rows += read_through(ctx, gcs)
        oc = sc.mount("oc", ctx.ram_size, gcs.mount_args("oc", "on-close"))
        try:
            rows += write_while_uploading(ctx, gcs, oc)
            rows += versus_rclone(ctx, gcs, oc)
        finally:
            sc.unmount(oc)
    finally:
        gcs.close()
    return rows


def upload(ctx: Context, gcs: Gcs) -> list[Row]:
    size = ctx.size
    src = ctx.ref_dir() / "upload-src"
    ctx.io.write(src, size, MiB, fsync=True)
    m = ctx.scratch.mount("up", ctx.ram_size, gcs.mount_args("up", "manual"))
    assert m.pid is not None
    m_pid = m.pid
    n = itertools.count()

    def ours() -> float:
        name = f"up-{next(n)}.bin"
        ctx.io.write(m.path / name, size, MiB, fsync=True)
        _quiesce([m_pid, gcs.pid])
        t0 = time.monotonic()
        persist_and_wait(m, name)
        t = time.monotonic() - t0
        if gcs.size_of(f"up/{name}") != size:
            raise BenchError(f"mtcfs reported up/{name} persisted, the bucket disagrees")
        (m.path / name).unlink()
        _settle(m)
        return mib_s(size, t)

    def theirs() -> tuple[float, float]:
        out = []
        for chunked in (True, False):
            blob = gcs.bucket.blob(f"ref/up-{next(n)}.bin")
            if not chunked:
                blob.chunk_size = size  # one request (a multiple of 256 KiB)
            _quiesce([m_pid, gcs.pid])
            t0 = time.monotonic()
            blob.upload_from_filename(str(src))
            out.append(mib_s(size, time.monotonic() - t0))
            blob.delete()
        return out[0], out[1]

    try:
        xs, ys = ctx.alternate(ours, theirs, label="upload MiB/s (ref: default/one request)")
    finally:
        ctx.scratch.unmount(m)
        src.unlink(missing_ok=True)
    name = f"upload of a closed {_size(size)} file"
    return [
        Row(
            "durable",
            name,
            "MiB/s",
            xs,
            [y[0] for y in ys],
            ref_label="gcs-python",
            min_ratio=0.9,
            note="mtcfs: persist request to GCS-confirmed; reference: "
            "Blob.upload_from_filename, library defaults (100 MiB chunks)",
        ),
        Row(
            "durable",
            f"{name}, reference in one request",
            "MiB/s",
            xs,
            [y[1] for y in ys],
            ref_label="gcs-python",
            note="for context: the same upload with blob.chunk_size = file size",
        ),
    ]


def read_through(ctx: Context, gcs: Gcs) -> list[Row]:
    size = ctx.size
    key = "rt/ckpt.bin"
    seed = ctx.scratch.mount("seed", ctx.ram_size, gcs.mount_args("rt", "manual"))
    try:
        ctx.io.write(seed.path / "ckpt.bin", size, MiB, fsync=True)
        persist_and_wait(seed, "ckpt.bin")
    finally:
        ctx.scratch.unmount(seed)  # the object stays in the bucket, the RAM copy goes
    if gcs.size_of(key) != size:
        raise BenchError(f"gs://{BUCKET}/{key} was not uploaded")
    dest = ctx.ref_dir() / "download"
    fetched: list[int] = []

    def ours() -> float:
        m = ctx.scratch.mount("rt", ctx.ram_size, gcs.mount_args("rt", "manual"))
        try:
            assert m.pid is not None
            drop_caches()
            _quiesce([m.pid, gcs.pid])
            t, got = ctx.io.read(m.path / "ckpt.bin", MiB)
            if got != size:
                raise BenchError(f"read {got} bytes through the mount, expected {size}")
            fetched.append(m.durable()["readthrough"]["fetched_bytes"])
        finally:
            ctx.scratch.unmount(m)
        return mib_s(size, t)

    def theirs() -> float:
        drop_caches()
        _quiesce([gcs.pid])
        t0 = time.monotonic()
        gcs.bucket.blob(key).download_to_filename(str(dest))
        t = time.monotonic() - t0
        if dest.stat().st_size != size:
            raise BenchError(f"downloaded {dest.stat().st_size} bytes, expected {size}")
        dest.unlink()
        return mib_s(size, t)

    xs, ys = ctx.alternate(ours, theirs, label="read-through MiB/s")
    if any(f != size for f in fetched):
        raise BenchError(f"read-through fetched {fetched} bytes, expected {size} each")
    return [
        Row(
            "durable",
            f"read-through of a {_size(size)} file only in GCS, cold",
            "MiB/s",
            xs,
            ys,
            ref_label="gcs-python",
            min_ratio=0.8,
            note="mtcfs: fresh mount, empty RAM dir, open to close of a 1 MiB-read loop; "
            "reference: Blob.download_to_filename into /dev/shm",
        )
    ]


# A google-cloud-storage upload in a process of its own: the control arm of
# write_while_uploading (the same load on the machine, no thread in the daemon).
EXTERNAL_UPLOAD = """
import sys
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
url, bucket, key, src, size = sys.argv[1:6]
client = storage.Client(project="mtcfs-bench", credentials=AnonymousCredentials(),
                        client_options={"api_endpoint": url})
blob = client.bucket(bucket).blob(key)
blob.chunk_size = int(size)  # one request, like mtcfs
print("ready", flush=True)
sys.stdin.readline()
blob.upload_from_filename(src)
"""


def write_while_uploading(ctx: Context, gcs: Gcs, m: Mount) -> list[Row]:
    """The trainer writes `size` while another file of `size` uploads, vs idle.

    Every run first writes a background file B, then at once the timed file A
    (C writer, 1 MiB writes, fsync, close). "busy": B is named so that the
    on-close policy uploads it as soon as it is closed, and A starts once the
    daemon reports the upload in flight. "idle": B has a temporary name
    (*.tmp), never uploaded. "external" (a control, no target): B is temporary
    and a separate process uploads the same number of bytes with
    google-cloud-storage (one request) to the same server while A is written:
    the same kind of load on the machine, but nothing in the daemon. A is
    always temporary, so its own upload does not follow. The CPU time the
    daemon and the server use during A is recorded."""
    size = ctx.size
    n = itertools.count()
    assert m.pid is not None
    daemon_pid = m.pid
    src = ctx.ref_dir() / "external-src"
    ctx.io.write(src, size, MiB, fsync=True)
    overlap: list[bool] = []
    cpu: dict[str, list[tuple[float, float, float]]] = {"busy": [], "idle": [], "ext": []}

    def one(kind: str) -> float:
        i = next(n)
        bg = m.path / (f"bg-{i}.bin" if kind == "busy" else f"bg-{i}.bin.tmp")
        ext: subprocess.Popen[str] | None = None
        _quiesce([daemon_pid, gcs.pid])
        ctx.io.write(bg, size, MiB, fsync=True)
        if kind == "busy":
            deadline = time.monotonic() + 10
            while not m.durable()["inflight_files"]:
                if time.monotonic() > deadline:
                    raise BenchError(f"the upload of {bg.name} did not start")
                time.sleep(0.005)
        elif kind == "ext":
            key = f"ext/bg-{i}.bin"
            ext = subprocess.Popen(
                [sys.executable, "-c", EXTERNAL_UPLOAD, gcs.url, BUCKET, key, str(src), str(size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert ext.stdin is not None and ext.stdout is not None
            ext.stdout.readline()  # imported and connected: start it now
            ext.stdin.write("go\n")
            ext.stdin.flush()
            time.sleep(0.05)  # the request under way, as with "busy"
        a = m.path / f"ckpt-{i}.bin.tmp"
        try:
            d0, s0 = cpu_seconds(daemon_pid), cpu_seconds(gcs.pid)
            t = ctx.io.write(a, size, MiB, fsync=True)
            d1, s1 = cpu_seconds(daemon_pid), cpu_seconds(gcs.pid)
        except BaseException:
            if ext is not None:
                ext.kill()
                ext.wait()
            raise
        if ext is not None:
            if ext.wait(timeout=600) != 0:
                raise BenchError("the external upload failed")
            gcs.bucket.blob(f"ext/bg-{i}.bin").delete()
        cpu[kind].append((t, d1 - d0, s1 - s0))
        if kind == "busy":
            overlap.append(m.durable()["inflight_files"] > 0)
            _settle(m)
            if gcs.size_of(f"oc/{bg.name}") != size:
                raise BenchError(f"oc/{bg.name} was not uploaded")
        bg.unlink()
        a.unlink()
        _settle(m)
        return mib_s(size, t)

    busy_and_external = alternating_pair(lambda: one("busy"), lambda: one("ext"))

    try:
        xs, ys = ctx.alternate(
            busy_and_external, lambda: one("idle"), label="write MiB/s (busy/external), idle"
        )
    finally:
        src.unlink(missing_ok=True)

    def cpu_note(kind: str) -> str:
        daemon = median([c[1] / c[0] for c in cpu[kind]])
        server = median([c[2] / c[0] for c in cpu[kind]])
        return f"{kind} {fmt(daemon)} / {fmt(server)}"

    note = (
        f"upload still in flight when the write ended: {sum(overlap)}/{len(overlap)} runs; "
        f"CPU s per s of write, daemon / fake-gcs-server: {cpu_note('busy')}, "
        f"{cpu_note('ext')}, {cpu_note('idle')}"
    )
    what = f"{_size(size)} write, 1 MiB writes"
    return [
        Row(
            "durable",
            f"{what}, while mtcfs uploads a {_size(size)} file",
            "MiB/s",
            [x[0] for x in xs],
            ys,
            ref_label="idle",
            min_ratio=0.8,
            note=note,
        ),
        Row(
            "durable",
            f"{what}, while another process uploads {_size(size)} (control)",
            "MiB/s",
            [x[1] for x in xs],
            ys,
            ref_label="idle",
            note="the same load on the machine from outside the daemon (google-cloud-storage, "
            "one request)",
        ),
    ]


def versus_rclone(ctx: Context, gcs: Gcs, m: Mount) -> list[Row]:
    size = ctx.size
    work = ctx.scratch.shm_dir("rclone")
    rc = Rclone(gcs, "rc", ctx.scratch.tmp / "mnt-rclone", work)
    ctx.scratch.defer(rc.stop)
    assert m.pid is not None and rc.proc is not None
    pids = [gcs.pid, m.pid, rc.proc.pid]
    n = itertools.count()

    def one(mp: Path, prefix: str, settle: Callable[[], object]) -> tuple[float, float]:
        name = f"ckpt-{next(n)}.bin"
        _quiesce(pids)
        t0 = time.monotonic()
        closed = ctx.io.write(mp / name, size, MiB, fsync=True)
        done = gcs.wait_object(f"{prefix}/{name}", size) - t0
        (mp / name).unlink()
        gcs.wait_gone(f"{prefix}/{name}")
        settle()
        return closed, done

    try:
        err.print(f"  {rc.version}: {' '.join(rc.args[1:])}", style="dim")
        # No warm-up: an rclone rep takes a minute on this server.
        xs, ys = ctx.alternate(
            lambda: one(m.path, "oc", lambda: _settle(m)),
            lambda: one(rc.mountpoint, "rc", lambda: None),
            label="checkpoint s close/in GCS",
            warmup=False,
        )
    finally:
        rc.stop()
    what = f"{_size(size)} checkpoint (1 MiB writes, fsync)"
    common: dict[str, Any] = dict(ref_label="rclone", higher_is_better=False, min_ratio=1.0)
    return [
        Row(
            "durable",
            f"{what}: open to close() returned",
            "s",
            [x[0] for x in xs],
            [y[0] for y in ys],
            **common,
        ),
        Row(
            "durable",
            f"{what}: open to object complete in GCS",
            "s",
            [x[1] for x in xs],
            [y[1] for y in ys],
            note="rclone: --vfs-cache-mode writes --vfs-write-back 0s",
            **common,
        ),
    ]
