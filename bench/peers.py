"""The peer tier beside its references: replication, restore reads, the
trainer's writes during replication, and the replicated index at scale.

Hosts are mtcfs daemons on loopback (`--listen 127.0.0.1:P --peers ...
--token-file F --replicas 1`), each with its own RAM dir; the reference for
moving bytes is a raw gRPC stream between two processes (bench/grpc_reference.py:
no protobuf, no checksums, 1 MiB chunks, a connected channel).

1. replication: host a writes a file (C writer, 1 MiB writes, fsync) and the
   clock runs from close() returning to `user.mtcfs.state` on a showing
   replicas >= 1 (polled every 5 ms); the push alone (open to the peer's reply)
   is taken from a's log line "replicated P to N (B bytes, S s)". Reference:
   grpc_reference.push_file of the same bytes from /dev/shm.
2. restore: a new host c (empty RAM dir, peers a and b, which both hold the
   file) reads the file with the C reader (1 MiB reads), open to close;
   reference: grpc_reference.fetch_file into /dev/shm. Then, for context, the
   same read on c again from its RAM tier (page cache dropped) and a fresh
   mount reading it through from GCS (bench/durable.py's read-through figure:
   fake-gcs-server vs google-cloud-storage's download).
3. trainer writes while replicating: a 1 GiB file is written on a right after
   another 1 GiB file was closed there (its replication to b under way), vs
   the same write once that replication is over; control: while a raw gRPC
   push of the same size runs between two other processes. Also the other
   side of the trade: the first file's close() to replica, during the write
   vs alone.
4. lookups: stat() on b of files a wrote (cold dentry cache) vs on a
   single-node mount, with the bytes b and a exchanged meanwhile (from `ss`).
5. index scale (bench/peers_index.py): 1 writer node and N-1 receiver nodes,
   index only (no FUSE): in-process mounts (mtcfs.assembly.build) with their
   gRPC servers, SWIM and dissemination trees, in two processes; 1,000 new
   entries on the writer, then the commit rule (wait_applied) on it: time to
   commit and until every node has them; CPU of the writer and of a receiver;
   the tree messages and bytes the writer sent; the idle (membership) CPU per
   host; ns.child().

A host's CPU time is that of its daemon and the daemon's worker processes
(replicas are pushed from a process pool). Everything started here is also
registered with Scratch.defer, so it is stopped after an error or Ctrl-C too.
Detailed per-rep figures (CPU lists: the warm-up first), and the commit of
mtcfs/ measured, go to bench/results/peers.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import durable
import grpc_reference
from common import (
    BENCH_DIR,
    BenchError,
    Context,
    MiB,
    Mount,
    Row,
    alternating_pair,
    code_version,
    cpu_seconds,
    drop_caches,
    err,
    fmt,
    median,
    mib_s,
    save_details,
)
from durable import _quiesce
from grpc_reference import GrpcServer
from ramtier import _size

from mtcfs import control

POLL = 0.005  # seconds between xattr polls
STATE = "user.mtcfs.state"
DETAILS = BENCH_DIR / "results" / "peers.json"
INDEX_SIZES = (8, 16, 32)  # 64 hosts in one process: SWIM misses its deadlines (docs)
INDEX_DIRS, INDEX_FILES = 10, 99  # 10 + 10 x 99 = 1,000 entries per rep
LOOKUP_DIRS, LOOKUP_FILES = 10, 1000



def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (the kernel's choice; held until all are picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def family(pid: int) -> list[int]:
    """The process and all its descendants (a daemon's replication workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return out


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants so far (the
    daemon pushes replicas from worker processes of its own)."""
    total = 0.0
    for p in family(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main
    thread, the one that serves FUSE in an mtcfs daemon."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        on, queued = f.read().split()[:2]
    return int(on) / 1e9, int(queued) / 1e9


def status(m: Mount) -> dict[str, Any]:
    """`mtcfs status --json` without the CLI's start-up."""
    return control.request(str(m.path), "status")["status"]


def prefetch_seconds(mountpoint: Path, rels: list[str]) -> float:
    """`mtcfs prefetch` without the CLI's start-up: request to every file in RAM
    (polled every 10 ms). Raises BenchError if a file failed."""
    t0 = time.monotonic()
    r = control.request(str(mountpoint), "prefetch", paths=rels, parallel=4)
    while True:
        st = control.request(str(mountpoint), "prefetch_progress", inos=r["inos"])
        if st["finished"]:
            t = time.monotonic() - t0
            if st["failed"] or st["files_done"] != len(rels):
                raise BenchError(f"prefetch on {mountpoint}: {st}")
            return t
        time.sleep(0.01)


def state(path: Path) -> dict[str, Any]:
    return json.loads(os.getxattr(path, STATE))


def yield_note() -> str:
    """Pushes that wait for the trainer's writes to stop (mtcfs.peer.mover.QUIET, in
    the versions that have it) start that long after the last write at the earliest."""
    try:
        from mtcfs.peer import mover
    except ImportError:
        return ""
    quiet = getattr(mover, "QUIET", None)
    return f"; includes the wait of {quiet:g} s after the last write (mover.QUIET)" if quiet else ""


def wait_replicated(path: Path, timeout: float = 300) -> float:
    """Poll the state xattr until the file has a peer copy; time.monotonic() then."""
    deadline = time.monotonic() + timeout
    while True:
        if state(path)["replicas"] >= 1:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(f"{path}: no replica after {timeout:.0f} s: {state(path)}")
        time.sleep(POLL)


_PUSH_LINE = re.compile(r"replicated (.+) to (\S+) \((\d+) bytes, ([\d.]+) s\)")


def push_seconds(m: Mount, rel: str) -> float:
    """The push duration of the last replication of `rel`, from the daemon's log."""
    found = None
    with open(m.ram_dir / "mtcfs.log", errors="replace") as f:
        for line in f:
            hit = _PUSH_LINE.search(line)
            if hit and hit.group(1) == rel:
                found = float(hit.group(4))
    if found is None:
        raise BenchError(f"no 'replicated {rel}' line in {m.ram_dir}/mtcfs.log")
    return found


def peer_bytes(ports: list[int]) -> int:
    """Bytes received so far on the TCP connections to or from these ports
    (each byte counted once, at its receiving end), from `ss -ti`."""
    flt = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( {flt} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(v) for v in re.findall(r"bytes_received:(\d+)", out))


class Cluster:
    """mtcfs hosts on loopback, all with one token file."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.token = ctx.scratch.tmp / "peer-token"
        self.token.write_text(secrets.token_hex(24) + "\n")
        self.token.chmod(0o600)
        self.ports: dict[str, int] = {}
        self.hosts: dict[str, Mount] = {}

    def port(self, name: str) -> int:
        if name not in self.ports:
            taken = set(self.ports.values())
            self.ports[name] = next(p for p in free_ports(8) if p not in taken)
        return self.ports[name]

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.port(name)}"

    def start(self, name: str, peers: list[str], replicas: int = 1,
              extra: Sequence[str] = ()) -> Mount:
        args = [
            "--node-id",
            name,
            "--listen",
            self.addr(name),
            "--peers",
            ",".join(self.addr(p) for p in peers),
            "--token-file",
            str(self.token),
            "--replicas",
            str(replicas),
            *extra,
            *os.environ.get("MTCFS_AB", "").split(),
        ]
        if "--data-listen" not in extra:
            # Any free port: the default (--listen's port + 1) may be taken by then.
            args += ["--data-listen", "127.0.0.1:0"]
        m = self.ctx.scratch.mount(name, self.ctx.ram_size, args)
        self.hosts[name] = m
        return m

    def stop(self, name: str) -> None:
        m = self.hosts.pop(name, None)
        if m is not None:
            self.ctx.scratch.unmount(m)

    def wait_live(self, m: Mount, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while status(m)["peers"]["live_peers"] < n:
            if time.monotonic() > deadline:
                raise BenchError(f"{m.path}: fewer than {n} live peers after {timeout:.0f} s")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        """The daemons and their worker processes."""
        return [p for m in self.hosts.values() if m.pid is not None for p in family(m.pid)]


def settle(*mounts: Mount, timeout: float = 120) -> None:
    """Wait until these hosts have nothing to replicate or broadcast, and no
    more RAM in use than their files account for (removed replicas gone)."""
    deadline = time.monotonic() + timeout
    for m in mounts:
        while True:
            st = status(m)
            p = st["peers"]
            if not (p["replication_queue"] or p["broadcast_queue"]) and not st["open_handles"]:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{m.path}: not settled after {timeout:.0f} s: {p}")
            time.sleep(0.02)


def wait_ram_below(m: Mount, limit: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while status(m)["ram"]["used"] > limit:
        if time.monotonic() > deadline:
            raise BenchError(f"{m.path}: RAM use still {status(m)['ram']['used']} > {limit}")
        time.sleep(0.02)


# -- the group -------------------------------------------------------------------


def group(ctx: Context) -> list[Row]:
    sc = ctx.scratch
    details: dict[str, Any] = {"size": ctx.size, "reps": ctx.reps, "code": code_version()}
    srv = GrpcServer(sc.shm_dir("grpc-ref"))
    sc.defer(srv.stop)
    sc.defer(grpc_reference.close_channels)
    cl = Cluster(ctx)
    rows: list[Row] = []
    try:
        err.print(f"  gRPC reference server at {srv.addr} (pid {srv.pid})", style="dim")
        a = cl.start("a", ["b"])
        b = cl.start("b", ["a"])
        cl.wait_live(a, 1)
        cl.wait_live(b, 1)
        err.print(
            f"  hosts a (pid {a.pid}, {cl.addr('a')}) and b (pid {b.pid}, {cl.addr('b')})",
            style="dim",
        )
        rows += replication(ctx, cl, srv, details)
        rows += restore(ctx, cl, srv, details)
        rows += write_while_replicating(ctx, cl, srv, details)
        rows += lookups(ctx, cl, details)
    finally:
        grpc_reference.close_channels()
        for name in list(cl.hosts):
            cl.stop(name)
        srv.stop()
    rows += index_scale(ctx, details)
    save_details(DETAILS, details)
    return rows


# -- 1. replication --------------------------------------------------------------


def replication(ctx: Context, cl: Cluster, srv: GrpcServer, details: dict[str, Any]) -> list[Row]:
    size = ctx.size
    a, b = cl.hosts["a"], cl.hosts["b"]
    assert a.pid is not None and b.pid is not None
    src = ctx.ref_dir() / "push-src"
    ctx.io.write(src, size, MiB, fsync=True)
    stored = srv.root / src.name
    n = itertools.count()
    base_b = status(b)["ram"]["used"]
    cpu: dict[str, list[tuple[float, float]]] = {"mtcfs": [], "ref": []}

    def ours() -> tuple[float, float]:
        name = f"rep-{next(n)}.bin"
        path = a.path / name
        _quiesce(cl.pids())
        ctx.io.write(path, size, MiB, fsync=True)
        t0 = time.monotonic()
        c0 = tree_cpu(a.pid), tree_cpu(b.pid)  # type: ignore[arg-type]
        t1 = wait_replicated(path)
        c1 = tree_cpu(a.pid), tree_cpu(b.pid)  # type: ignore[arg-type]
        push = push_seconds(a, name)
        cpu["mtcfs"].append((c1[0] - c0[0], c1[1] - c0[1]))
        path.unlink()
        settle(a, b)
        wait_ram_below(b, base_b + MiB)
        return mib_s(size, t1 - t0), mib_s(size, push)

    def theirs() -> float:
        stored.unlink(missing_ok=True)  # no truncate in the timed push
        _quiesce([*cl.pids(), srv.pid])
        c0 = time.process_time(), srv.cpu_seconds()
        t = grpc_reference.push_file(srv.addr, src, MiB)
        c1 = time.process_time(), srv.cpu_seconds()
        cpu["ref"].append((c1[0] - c0[0], c1[1] - c0[1]))
        stored.unlink(missing_ok=True)
        return mib_s(size, t)

    try:
        xs, ys = ctx.alternate(ours, theirs, label="replication MiB/s (close->replica/push)")
    finally:
        src.unlink(missing_ok=True)
        stored.unlink(missing_ok=True)

    def per_gib(pairs: list[tuple[float, float]]) -> str:
        k = (1 << 30) / size
        pairs = pairs[-ctx.reps :]  # not the warm-up
        return f"{fmt(median([p[0] for p in pairs]) * k)}/{fmt(median([p[1] for p in pairs]) * k)}"

    details["replication"] = {
        "close_to_replica_mib_s": [x[0] for x in xs],
        "push_from_log_mib_s": [x[1] for x in xs],
        "grpc_push_mib_s": ys,
        "cpu_s_sender_receiver": cpu["mtcfs"],
        "cpu_s_ref_client_server": cpu["ref"],
    }
    what = f"replication of a closed {_size(size)} file to 1 peer"
    note = (
        f"CPU s per GiB, sender/receiver: mtcfs {per_gib(cpu['mtcfs'])}, "
        f"raw gRPC {per_gib(cpu['ref'])}"
    )
    return [
        Row(
            "peers",
            f"{what}: close() to replicas >= 1",
            "MiB/s",
            [x[0] for x in xs],
            ys,
            ref_label="grpc-raw",
            min_ratio=0.7,
            note="state xattr polled every 5 ms; reference: raw gRPC push, 1 MiB chunks; "
            + note
            + yield_note(),
        ),
        Row(
            "peers",
            f"{what}: the push alone (daemon log)",
            "MiB/s",
            [x[1] for x in xs],
            ys,
            ref_label="grpc-raw",
            note="open of the RAM file to the peer's reply, as the daemon logs it (10 ms steps)",
        ),
    ]


# -- 2. restore ------------------------------------------------------------------


def restore(ctx: Context, cl: Cluster, srv: GrpcServer, details: dict[str, Any]) -> list[Row]:
    size = ctx.size
    a, b = cl.hosts["a"], cl.hosts["b"]
    rel = "restore/ckpt.bin"
    (a.path / "restore").mkdir()
    ctx.io.write(a.path / rel, size, MiB, fsync=True)
    wait_replicated(a.path / rel)
    settle(a, b)
    st = state(a.path / rel)
    if sorted(st["holders"]) != ["a", "b"]:
        raise BenchError(f"{rel} should be on a and b only: {st}")
    # The reference serves the same bytes (copied untimed from a's RAM tier).
    shutil.copyfile(a.path / rel, srv.root / "ckpt.bin")
    dest = ctx.ref_dir() / "fetched.bin"
    n = itertools.count()
    sources: list[str] = []
    # CPU s: (the new host, the holders a and b) / (the client, the server)
    cpu: dict[str, list[tuple[float, float]]] = {"mtcfs": [], "ref": []}

    def ours() -> tuple[float, float]:
        name = f"c{next(n)}"
        c = cl.start(name, ["a", "b"])
        try:
            assert c.pid is not None
            _quiesce([*cl.pids(), srv.pid])
            c0 = tree_cpu(c.pid), tree_cpu(a.pid) + tree_cpu(b.pid)  # type: ignore[arg-type]
            t, got = ctx.io.read(c.path / rel, MiB)
            c1 = tree_cpu(c.pid), tree_cpu(a.pid) + tree_cpu(b.pid)  # type: ignore[arg-type]
            cpu["mtcfs"].append((c1[0] - c0[0], c1[1] - c0[1]))
            if got != size:
                raise BenchError(f"read {got} bytes on {name}, expected {size}")
            by_source = status(c)["peers"]["bytes_fetched_by_source"]
            sources.append(",".join(sorted(by_source)))
            if sum(by_source.values()) != size:
                raise BenchError(f"{name} fetched {by_source}, expected {size} bytes from peers")
            drop_caches()  # the page cache: the second read comes from c's RAM tier
            t2, got = ctx.io.read(c.path / rel, MiB)
            if got != size:
                raise BenchError(f"read {got} bytes on {name} (again), expected {size}")
        finally:
            cl.stop(name)
        return mib_s(size, t), mib_s(size, t2)

    def theirs() -> float:
        _quiesce([*cl.pids(), srv.pid])
        c0 = time.process_time(), srv.cpu_seconds()
        t = grpc_reference.fetch_file(srv.addr, "ckpt.bin", dest, MiB)
        c1 = time.process_time(), srv.cpu_seconds()
        cpu["ref"].append((c1[0] - c0[0], c1[1] - c0[1]))
        got = dest.stat().st_size
        dest.unlink()
        if got != size:
            raise BenchError(f"raw gRPC fetch got {got} bytes, expected {size}")
        return mib_s(size, t)

    try:
        xs, ys = ctx.alternate(ours, theirs, label="restore MiB/s (peer/local RAM), raw fetch")
    finally:
        dest.unlink(missing_ok=True)
        (srv.root / "ckpt.bin").unlink(missing_ok=True)
        (a.path / rel).unlink()
        (a.path / "restore").rmdir()
        settle(a, b)

    # The same file restored from GCS instead: bench/durable.py's read-through.
    gcs = durable.Gcs(ctx.scratch.shm_dir("gcs-peers"))
    ctx.scratch.defer(gcs.close)
    try:
        err.print(f"  fake-gcs-server at {gcs.url} (pid {gcs.pid})", style="dim")
        gcs_rows = durable.read_through(ctx, gcs)
    finally:
        gcs.close()
    gcs_row = gcs_rows[0]
    gcs_row.group = "peers"
    gcs_row.name = "restore: " + gcs_row.name

    peer = [x[0] for x in xs]
    local = [x[1] for x in xs]
    details["restore"] = {
        "peer_mib_s": peer,
        "local_ram_mib_s": local,
        "grpc_fetch_mib_s": ys,
        "gcs_readthrough_mib_s": gcs_row.mtcfs,
        "gcs_download_mib_s": gcs_row.ref,
        "served_by": sources,
        "cpu_s_new_host_holders": cpu["mtcfs"],
        "cpu_s_ref_client_server": cpu["ref"],
    }
    k = (1 << 30) / size

    def per_gib(pairs: list[tuple[float, float]]) -> str:
        pairs = pairs[-ctx.reps :]  # not the warm-up
        return f"{fmt(median([p[0] for p in pairs]) * k)}/{fmt(median([p[1] for p in pairs]) * k)}"

    what = f"restore: read of a {_size(size)} file on a new host"
    return [
        Row(
            "peers",
            f"{what} from a peer",
            "MiB/s",
            peer,
            ys,
            ref_label="grpc-raw",
            min_ratio=0.8,
            note="new host c, empty RAM dir, peers a and b hold the file; timed once c's "
            "start-up CPU has settled; open to close of a 1 MiB-read loop; reference: raw "
            "gRPC fetch into /dev/shm, 1 MiB chunks; "
            f"CPU s per GiB, receiving/serving side: mtcfs {per_gib(cpu['mtcfs'])}, "
            f"raw gRPC {per_gib(cpu['ref'])}",
        ),
        Row(
            "peers",
            f"{what}: from a peer vs from its own RAM",
            "MiB/s",
            peer,
            local,
            ref_label="local RAM",
            note="for context: the same file read again on c once cached (page cache dropped)",
        ),
        Row(
            "peers",
            f"{what}: from a peer vs from GCS",
            "MiB/s",
            peer,
            gcs_row.mtcfs,
            ref_label="gcs",
            note="for context: a fresh mount over the bucket (fake-gcs-server), no peers",
        ),
        gcs_row,
    ]


# -- 3. writes while replicating -------------------------------------------------

# A raw gRPC push in a process of its own: the control arm of
# write_while_replicating (the same kind of load on the machine, no daemon in it).
EXTERNAL_PUSH = """
import sys
sys.path.insert(0, sys.argv[1])
import grpc_reference
addr, src = sys.argv[2:4]
grpc_reference.channel(addr)
print("ready", flush=True)
sys.stdin.readline()
grpc_reference.push_file(addr, src, 1 << 20, name="external.bin")
grpc_reference.close_channels()
"""


def write_while_replicating(
    ctx: Context, cl: Cluster, srv: GrpcServer, details: dict[str, Any]
) -> list[Row]:
    """The trainer writes `size` on a while another file of `size` replicates
    to b, vs the same write with the peer tier idle.

    Every run first writes a background file B, then the timed file A (C
    writer, 1 MiB writes, fsync, close). "busy": A starts as soon as B's
    close() returned (B's replication starts at its seal). "idle": A starts
    once B is replicated and the daemons are quiet. "external" (a control,
    no target): as idle, but a raw gRPC push of `size` between two other
    processes runs while A is written. A's own replication then follows in
    every arm (untimed); both files are deleted before the next run.

    Also timed: B's close() to B replicated, in "busy" (while A is written;
    mtcfs may hold replication back while the trainer writes) and in "idle"
    (nothing else running)."""
    size = ctx.size
    a, b = cl.hosts["a"], cl.hosts["b"]
    assert a.pid is not None and b.pid is not None
    src = ctx.ref_dir() / "external-src"
    ctx.io.write(src, size, MiB, fsync=True)
    base_b = status(b)["ram"]["used"]
    n = itertools.count()
    overlap: list[bool] = []  # busy: B not replicated yet when A's write ended
    delay: dict[str, list[float]] = {"busy": [], "idle": []}  # B's close() to replicated
    cpu: dict[str, list[tuple[float, float, float]]] = {"busy": [], "idle": [], "ext": []}
    # a's thread that serves FUSE: (write s, its s on a CPU, its s waiting for a CPU)
    fuse: dict[str, list[tuple[float, float, float]]] = {"busy": [], "idle": [], "ext": []}

    def one(kind: str) -> float:
        i = next(n)
        bg, fg = a.path / f"bg-{i}.bin", a.path / f"ckpt-{i}.bin"
        ext: subprocess.Popen[str] | None = None
        _quiesce(cl.pids())
        ctx.io.write(bg, size, MiB, fsync=True)
        bg_closed = time.monotonic()
        if kind != "busy":
            replicated = wait_replicated(bg)
            if kind == "idle":
                delay[kind].append(replicated - bg_closed)
            settle(a)
            _quiesce([*cl.pids(), srv.pid])
        if kind == "ext":
            ext = subprocess.Popen(
                [sys.executable, "-c", EXTERNAL_PUSH, str(BENCH_DIR), srv.addr, str(src)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert ext.stdin is not None and ext.stdout is not None
            ext.stdout.readline()  # imported and connected: start it now
            ext.stdin.write("go\n")
            ext.stdin.flush()
            time.sleep(0.02)  # the push under way
        try:
            d0, e0 = tree_cpu(a.pid), tree_cpu(b.pid)  # type: ignore[arg-type]
            s0 = schedstat(a.pid)  # type: ignore[arg-type]
            t = ctx.io.write(fg, size, MiB, fsync=True)
            s1 = schedstat(a.pid)  # type: ignore[arg-type]
            d1, e1 = tree_cpu(a.pid), tree_cpu(b.pid)  # type: ignore[arg-type]
        finally:
            if ext is not None and ext.wait(timeout=600) != 0:
                raise BenchError("the external push failed")
        cpu[kind].append((t, d1 - d0, e1 - e0))
        fuse[kind].append((t, s1[0] - s0[0], s1[1] - s0[1]))
        if kind == "busy":
            overlap.append(state(bg)["replicas"] == 0)
            delay[kind].append(wait_replicated(bg) - bg_closed)
        wait_replicated(fg)
        bg.unlink()
        fg.unlink()
        (srv.root / "external.bin").unlink(missing_ok=True)
        settle(a, b)
        wait_ram_below(b, base_b + MiB)
        return mib_s(size, t)

    busy_and_external = alternating_pair(lambda: one("busy"), lambda: one("ext"))

    try:
        xs, ys = ctx.alternate(
            busy_and_external, lambda: one("idle"), label="write MiB/s (busy/external), idle"
        )
    finally:
        src.unlink(missing_ok=True)

    def cpu_note(kind: str) -> str:
        runs = cpu[kind][-ctx.reps :]  # not the warm-up
        sender = median([c[1] / c[0] for c in runs])
        receiver = median([c[2] / c[0] for c in runs])
        return f"{kind} {fmt(sender)}/{fmt(receiver)}"

    def fuse_note(kind: str) -> str:
        runs = fuse[kind][-ctx.reps :]
        on = median([f[1] for f in runs])
        queued = median([f[2] for f in runs])
        rest = median([f[0] - f[1] - f[2] for f in runs])
        return f"{kind} {fmt(on)}/{fmt(queued)}/{fmt(rest)}"

    details["write_while_replicating"] = {
        "busy_mib_s": [x[0] for x in xs],
        "external_mib_s": [x[1] for x in xs],
        "idle_mib_s": ys,
        "first_file_not_replicated_when_write_ended": overlap,
        "first_file_close_to_replicated_s": delay,
        "seconds_cpu_a_cpu_b": cpu,
        "seconds_write_fuse_thread_on_cpu_runqueue": fuse,
    }
    note = (
        f"the first file not yet replicated when the write ended: {sum(overlap)}/{len(overlap)} "
        "runs; "
        f"CPU s per s of write, host a/host b: {cpu_note('busy')}, {cpu_note('ext')}, "
        f"{cpu_note('idle')}; a's FUSE thread during the write, s on a CPU/waiting for a "
        f"CPU/other (idle, GIL, waiting for requests): {fuse_note('busy')}, "
        f"{fuse_note('ext')}, {fuse_note('idle')}"
    )
    what = f"{_size(size)} write on a, 1 MiB writes"
    return [
        Row(
            "peers",
            f"{what}, while a {_size(size)} file replicates to b",
            "MiB/s",
            [x[0] for x in xs],
            ys,
            ref_label="idle",
            min_ratio=0.8,
            note=note,
        ),
        Row(
            "peers",
            f"{what}, while another process pair streams {_size(size)} (control)",
            "MiB/s",
            [x[1] for x in xs],
            ys,
            ref_label="idle",
            note="the same kind of load on the machine from outside the daemons "
            "(raw gRPC push, 1 MiB chunks)",
        ),
        Row(
            "peers",
            f"the first file's replication, close() to replica on b: while the next "
            f"{_size(size)} is written vs alone",
            "s",
            delay["busy"][-ctx.reps :],
            delay["idle"][-ctx.reps :],
            ref_label="alone",
            higher_is_better=False,
            note="what the write above costs the replication: pushes that yield to the "
            "trainer's writes finish later",
        ),
    ]


# -- 4. lookups on a real mount --------------------------------------------------


def _stat_pass(paths: list[Path]) -> tuple[float, int]:
    """Seconds per stat() of each path (cold dentry cache), and how many existed."""
    drop_caches()
    found = 0
    t0 = time.perf_counter()
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.stat(p)
            found += 1
    return (time.perf_counter() - t0) / len(paths), found


def lookups(ctx: Context, cl: Cluster, details: dict[str, Any]) -> list[Row]:
    """stat() on b of files a wrote, and of names nobody made, vs a single-node
    mount: the index is local, so a lookup costs what it costs on one node."""
    a, b = cl.hosts["a"], cl.hosts["b"]
    single = ctx.mtcfs()
    rel = [f"lk/d{i % LOOKUP_DIRS:03d}/f{i:06d}" for i in range(LOOKUP_FILES)]
    missing = [f"lk/d{i % LOOKUP_DIRS:03d}/.metadata{i}" for i in range(LOOKUP_FILES)]
    for m in (a, single):
        (m.path / "lk").mkdir()
        ctx.io.tree(m.path / "lk", LOOKUP_DIRS, LOOKUP_FILES, 4096, 4096)
    want = LOOKUP_FILES + LOOKUP_DIRS + 1
    deadline = time.monotonic() + 60
    while status(b)["peers"]["index"]["entries"] < want:
        if time.monotonic() > deadline:
            raise BenchError(f"b did not get the {want} entries a made")
        time.sleep(0.02)
    settle(a, b)
    ports = [cl.port("a"), cl.port("b")]
    wire: list[tuple[int, int, float]] = []  # (bytes during the pass, idle bytes, seconds)

    def ours() -> tuple[float, float]:
        before = peer_bytes(ports)
        f0 = status(b)["peers"]["fetched_files"]
        t0 = time.monotonic()
        hit, found = _stat_pass([b.path / r for r in rel])
        miss, _ = _stat_pass([b.path / r for r in missing])
        took = time.monotonic() - t0
        during = peer_bytes(ports) - before
        if found != LOOKUP_FILES or status(b)["peers"]["fetched_files"] != f0:
            raise BenchError(f"b found {found} of {LOOKUP_FILES} files, or fetched data")
        before = peer_bytes(ports)
        time.sleep(took)  # the health checks' traffic in as much time, nothing else running
        wire.append((during, peer_bytes(ports) - before, took))
        return hit * 1e6, miss * 1e6

    def theirs() -> tuple[float, float]:
        hit, found = _stat_pass([single.path / r for r in rel])
        miss, _ = _stat_pass([single.path / r for r in missing])
        if found != LOOKUP_FILES:
            raise BenchError(f"found {found} of {LOOKUP_FILES} files on the single-node mount")
        return hit * 1e6, miss * 1e6

    try:
        xs, ys = ctx.alternate(ours, theirs, label="stat µs (file/missing name)")
    finally:
        for m in (a, single):
            shutil.rmtree(m.path / "lk", ignore_errors=True)
        settle(a, b)
    details["lookups"] = {
        "host_b_us": xs,
        "single_node_us": ys,
        "peer_bytes_during_idle_seconds": wire,
    }
    during = median([w[0] for w in wire])
    idle = median([w[1] for w in wire])
    took = median([w[2] for w in wire])
    note = (
        f"bytes between a and b during the {2 * LOOKUP_FILES:,} stat()s ({took:.2f} s): "
        f"{during:,.0f}; in as long idle (health checks): {idle:,.0f}"
    )
    what = f"stat() of {LOOKUP_FILES:,} names in {LOOKUP_DIRS} dirs on host b, cold dentries"
    return [
        Row(
            "peers",
            f"{what}: files host a wrote",
            "µs",
            [x[0] for x in xs],
            [y[0] for y in ys],
            ref_label="1 node",
            higher_is_better=False,
            note=note,
        ),
        Row(
            "peers",
            f"{what}: names nobody made (ENOENT)",
            "µs",
            [x[1] for x in xs],
            [y[1] for y in ys],
            ref_label="1 node",
            higher_is_better=False,
            note="a miss is answered from the local index too",
        ),
    ]


# -- 5. the index at scale -------------------------------------------------------


class IndexProc:
    """A bench/peers_index.py process hosting some of the simulated nodes."""

    def __init__(self, root: Path, mine: list[list[Any]], everyone: list[list[Any]],
                 token_file: Path) -> None:
        self.proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "peers_index.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self.send({"root": str(root), "token_file": str(token_file), "mine": mine,
                   "all": everyone})

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 300) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        if not line:
            raise BenchError(f"index helper {self.pid} did not answer (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self, obj: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        self.send(obj)
        return self.read(timeout)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def index_run(ctx: Context, nodes: int) -> dict[str, Any]:
    """One writer process (node 0) and one process with the other nodes."""
    root = ctx.scratch.shm_dir(f"index-{nodes}")
    everyone = [[f"n{i:02d}", p] for i, p in enumerate(free_ports(nodes))]
    token = root / "token"
    token.write_text(secrets.token_hex(24) + "\n")
    procs: list[IndexProc] = []
    out: dict[str, Any] = {"nodes": nodes, "reps": []}
    try:
        t0 = time.monotonic()
        # Both start at once: each host waits for its peers to answer before it is live.
        rx = IndexProc(root, everyone[1:], everyone, token)
        procs.append(rx)
        ctx.scratch.defer(rx.stop)
        wx = IndexProc(root, everyone[:1], everyone, token)
        procs.append(wx)
        ctx.scratch.defer(wx.stop)
        rx.read(timeout=300)
        ready = wx.read(timeout=300)
        out["start_s"] = time.monotonic() - t0
        if ready["live"] != [nodes - 1]:
            raise BenchError(f"the writer sees {ready['live']} live peers of {nodes - 1}")
        # Membership alone (SWIM over datagrams): what one host of N costs idle.
        rx.send({"op": "idle", "seconds": 3.0, "settle": 1.5})
        w_idle = wx.ask({"op": "idle", "seconds": 3.0, "settle": 1.5})
        r_idle = rx.read()
        out["idle_cpu_per_s"] = {"writer": w_idle["cpu_per_s"],
                                 "receivers": r_idle["cpu_per_s"]}
        out["idle_datagrams_per_host_s"] = (w_idle["datagrams_per_s"]
                                            + r_idle["datagrams_per_s"]) / nodes
        baseline = r_idle["cpu_per_s"]
        per_rep = INDEX_DIRS * (INDEX_FILES + 1)
        for rep in range(ctx.reps + 1):  # the first is a warm-up
            rx.send({"op": "expect", "entries": per_rep * (rep + 1)})
            time.sleep(0.05)
            go = wx.ask(
                {
                    "op": "go",
                    "dirs": INDEX_DIRS,
                    "files": INDEX_FILES,
                    "tag": f"r{rep}",
                    "mode": "trickle",
                }
            )
            got = rx.read()
            if got["missing"] or go["late"]:
                raise BenchError(f"{len(got['missing'])} nodes did not get the entries; "
                                 f"the commit did not hear from {go['late']}")
            sent = wx.ask({"op": "stats"})
            if rep:
                out["reps"].append(
                    {
                        "commit_s": go["commit_s"],
                        "all_nodes_s": got["last"] - go["t0"],
                        "first_node_s": got["first"] - go["t0"],
                        "made_s": go["made_s"],
                        "writer_cpu_s": sent["cpu"] - w_idle["cpu_per_s"] * go["commit_s"],
                        "batches_sent": sent["batches"],
                        "entries_sent": sent["entries"],
                        "messages_sent": sent["messages"],
                        "bytes_sent": sent["bytes"],
                        "receivers_cpu_s": got["cpu"] - baseline * got["seconds"],
                        "receivers_cpu_s_gross": got["cpu"],
                        "batches_received": got["batches"],
                    }
                )
        out["lookup"] = rx.ask({"op": "lookup", "rounds": 20})
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def idle(r: dict[str, Any]) -> float:
    """One idle host's share of a core: the receivers' process over its hosts."""
    return r["idle_cpu_per_s"]["receivers"] / (r["nodes"] - 1)


def index_scale(ctx: Context, details: dict[str, Any]) -> list[Row]:
    runs = []
    for nodes in INDEX_SIZES:
        r = index_run(ctx, nodes)
        runs.append(r)
        reps = r["reps"]
        err.print(
            f"  N={nodes}: started in {r['start_s']:.1f} s; 1,000 entries committed in "
            f"{fmt(median([x['commit_s'] for x in reps]))} s, on every node in "
            f"{fmt(median([x['all_nodes_s'] for x in reps]))} s (first node "
            f"{fmt(median([x['first_node_s'] for x in reps]))} s); writer CPU "
            f"{fmt(median([x['writer_cpu_s'] for x in reps]) * 1e3)} ms, "
            f"{median([x['batches_sent'] for x in reps]):.0f} batches, "
            f"{median([x['messages_sent'] for x in reps]):.0f} messages, "
            f"{median([x['bytes_sent'] for x in reps]) / 1e6:.2f} MB; receiver CPU "
            f"{fmt(median([x['receivers_cpu_s'] for x in reps]) / (nodes - 1) * 1e3)} ms each; "
            f"idle {fmt(idle(r) * 100)} % of a core per host",
            style="dim",
        )
    details["index"] = runs
    small, big = runs[0], runs[-1]
    ns_, nb = small["nodes"], big["nodes"]
    entries = INDEX_DIRS * (INDEX_FILES + 1)

    def writer(r: dict[str, Any]) -> list[float]:  # ms of the writer's CPU
        return [x["writer_cpu_s"] * 1e3 for x in r["reps"]]

    def per_receiver(r: dict[str, Any]) -> list[float]:  # ms per receiving node
        return [x["receivers_cpu_s"] / (r["nodes"] - 1) * 1e3 for x in r["reps"]]

    def summary(fn: Callable[[dict[str, Any]], list[float]]) -> str:
        return ", ".join(f"N={r['nodes']}: {fmt(median(fn(r)))}" for r in runs)

    rows = []
    for r in runs:
        first = fmt(median([x["first_node_s"] for x in r["reps"]]))
        every = fmt(median([x["all_nodes_s"] for x in r["reps"]]))
        rows.append(
            Row(
                "peers",
                f"index: {entries:,} new entries from 1 host, commit with {r['nodes']} hosts",
                "s",
                [x["commit_s"] for x in r["reps"]],
                higher_is_better=False,
                note=f"until every host applied them (the commit rule, acks up the tree); "
                f"on every host after {every} s, first after {first} s; the {r['nodes'] - 1} "
                "receivers share one process (one trio thread, 2 cores), so their applies "
                "run one after another here",
            )
        )
    msgs = median([x["messages_sent"] for x in big["reps"]])
    kb = median([x["bytes_sent"] for x in big["reps"]]) / 1e3
    rows += [
        Row(
            "peers",
            f"index: the writer's CPU per {entries:,} entries, N={nb} vs N={ns_}",
            "ms",
            writer(big),
            writer(small),
            ref_label=f"N={ns_}",
            higher_is_better=False,
            min_ratio=0.8,
            note=f"{summary(writer)}; at N={nb}: {msgs:.0f} tree messages sent ({kb:,.0f} kB); "
            ">= 0.8x: the writer sends to at most 8 hosts whatever N",
        ),
        Row(
            "peers",
            f"index: a receiver's CPU per {entries:,} entries, N={nb} vs N={ns_}",
            "ms",
            per_receiver(big),
            per_receiver(small),
            ref_label=f"N={ns_}",
            higher_is_better=False,
            min_ratio=0.8,
            note=f"{summary(per_receiver)}; applying a batch and forwarding it down the "
            "tree (less the receivers' process's idle CPU)",
        ),
        Row(
            "peers",
            f"index: membership, one idle host's CPU, N={nb} vs N={ns_}",
            "%",
            [idle(big) * 100],
            [idle(small) * 100],
            ref_label=f"N={ns_}",
            higher_is_better=False,
            note=f"SWIM over datagrams ({fmt(big['idle_datagrams_per_host_s'])} datagrams per "
            f"host per second at N={nb}) and the daemon's other idle loops; "
            + ", ".join(f"N={r['nodes']}: {fmt(idle(r) * 100)} %" for r in runs),
        ),
        Row(
            "peers",
            f"index: lookup of a name, ns.child(), {big['lookup']['names']:,} names",
            "ns",
            [big["lookup"]["child_ns"]],
            note=f"two-level path walk: {fmt(big['lookup']['walk_ns'])} ns; no network",
        ),
    ]
    return rows
