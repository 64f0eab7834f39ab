"""The bulk data channel (mtcfs.peer.bulk) beside a raw sendfile() stream.

Reference, measured in the same run: one Python process sendfile()s a file from
/dev/shm over a loopback TCP connection to another Python process, which
recv_into()s a reused 4 MiB buffer and pwrite()s it into a file on a tmpfs with
huge pages (huge=within_size, as the RAM tier); the clock runs from connect() to
the receiver's acknowledgement of the last byte. That is the floor of what the
channel does per byte, without its tags, crc32cs, RAM-tier bookkeeping and FUSE.
Memory is warmed before every timed part on both sides (Scratch.warm).

1. replication: host a writes a file (C writer, 1 MiB writes, fsync); the push
   alone (open to the peer's reply) is taken from a's log line "replicated P to
   N (B bytes, S s)"; close() to `replicas >= 1` is shown too.
2. restore from one holder: a new host c, peered with a only (so a is its only
   live holder of the file, held by a and b), reads it with the C reader, open
   to close, from an empty RAM tier; then a new host d, peered with a and b,
   reads it too (a striped restore from two holders).
3. restore into RAM without reading it (`mtcfs prefetch`, what a replacement
   host runs before its trainer starts): a new host e, peered with a only,
   from the request to every block verified in its RAM tier.
4. replication with --peer-encryption: hosts x and y (both encrypting) in place
   of a and b, the push alone.

Each rep writes a new file and starts new readers (untimed).
"""

from __future__ import annotations

import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    BenchError,
    Context,
    MiB,
    Row,
    code_version,
    cpu_seconds,
    err,
    median,
    mib_s,
    save_details,
)
from peers import (
    Cluster,
    prefetch_seconds,
    push_seconds,
    settle,
    state,
    status,
    wait_replicated,
)
from ramtier import _size

from mtcfs.config import process_alive

DETAILS = BENCH_DIR / "results" / "bulk.json"

# The reference's receiver: argv address, destination file, size (also bench/netns_restore).
RECEIVER = r"""
import os, socket, sys
addr, dest, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
ls = socket.socket(); ls.bind((addr, 0)); ls.listen(1)
print(ls.getsockname()[1], flush=True)
s, _ = ls.accept()
fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
buf = bytearray(4 << 20); view = memoryview(buf); off = 0
while off < size:
    n = s.recv_into(view[:min(len(buf), size - off)])
    if not n:
        sys.exit("short stream")
    os.pwrite(fd, view[:n], off); off += n
os.close(fd); s.sendall(b"k"); s.close()
"""


def sendfile_stream(src: Path, dest: Path) -> float:
    """Seconds to move src into dest: sendfile() here, recv_into + pwrite in another
    Python process (connect to acknowledgement)."""
    size = src.stat().st_size
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(dest), str(size)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with open(src, "rb") as f:
            t0 = time.monotonic()
            s = socket.create_connection(("127.0.0.1", port))
            s.sendfile(f)
            if s.recv(1) != b"k":
                raise BenchError("the sendfile reference's receiver failed")
            t = time.monotonic() - t0
            s.close()
    finally:
        proc.wait(timeout=60)
        dest.unlink(missing_ok=True)
    return t


def group(ctx: Context) -> list[Row]:
    size = ctx.size
    details: dict[str, Any] = {"size": size, "reps": ctx.reps, "code": code_version()}
    cl = Cluster(ctx)
    ref_src = ctx.ref_dir() / "sendfile-src"
    ctx.io.write(ref_src, size, MiB, fsync=True)
    ref_dest = ctx.scratch.huge_dir("ref") / "sendfile-dest"
    n = itertools.count()
    try:
        # a and b list only each other: a's replicas go to b. The readers (c: peered
        # with a only, d: with a and b) start after the files are written (a does not
        # broadcast to them; they pull its snapshot), with empty RAM tiers.
        a = cl.start("a", ["b"])
        b = cl.start("b", ["a"])
        ex = cl.start("x", ["y"], extra=["--peer-encryption"])
        ey = cl.start("y", ["x"], extra=["--peer-encryption"])
        for m in (a, b, ex, ey):
            cl.wait_live(m, 1)
            if not status(m)["peers"]["data_port"]:
                raise BenchError(f"{m.path}: no data channel (data_port)")
        err.print("  hosts a, b (holders); per rep c (peered with a) and d (with a and b)",
                  style="dim")

        gib = size / (1 << 30)
        cpu: dict[str, list[float]] = {k: [] for k in (
            "push_sender", "push_receiver", "prefetch_holder", "prefetch_reader",
            "encrypted_sender", "encrypted_receiver")}

        def ours() -> tuple[float, float, float, float, float, float]:
            i = next(n)
            name = f"bulk-{i}.bin"
            path = a.path / name
            ctx.scratch.warm(2 * size)  # a's file and b's replica (see Scratch.warm)
            ctx.io.write(path, size, MiB, fsync=True)
            t0 = time.monotonic()
            ca, cb = cpu_seconds(a.pid), cpu_seconds(b.pid)
            t1 = wait_replicated(path)
            cpu["push_sender"].append((cpu_seconds(a.pid) - ca) / gib)
            cpu["push_receiver"].append((cpu_seconds(b.pid) - cb) / gib)
            t_close, t_push = t1 - t0, push_seconds(a, name)
            settle(a, b)
            if sorted(state(path)["holders"]) != ["a", "b"]:
                raise BenchError(f"{name} should be on a and b: {state(path)}")
            c = cl.start(f"c{i}", ["a"], replicas=0)
            d = cl.start(f"d{i}", ["a", "b"], replicas=0)
            e = cl.start(f"e{i}", ["a"], replicas=0)
            try:
                ctx.scratch.warm(2 * size)  # the new host's copy and the reader's page cache
                t_one, got = ctx.io.read(c.path / name, MiB)
                ctx.scratch.warm(2 * size)
                t_two, got2 = ctx.io.read(d.path / name, MiB)
                ctx.scratch.warm(2 * size)
                ca, ce = cpu_seconds(a.pid), cpu_seconds(e.pid)
                t_pre = prefetch_seconds(e.path, [name])
                cpu["prefetch_holder"].append((cpu_seconds(a.pid) - ca) / gib)
                cpu["prefetch_reader"].append((cpu_seconds(e.pid) - ce) / gib)
                if state(e.path / name)["crc32c"] != state(path)["crc32c"]:
                    raise BenchError(f"e's copy of {name} differs: {state(e.path / name)}")
                if got != size or got2 != size:
                    raise BenchError(f"restores read {got} and {got2} bytes of {size}")
                if set(status(d)["fetch"]["bytes_by_source"]) != {"a", "b"}:
                    raise BenchError(f"d read from {status(d)['fetch']['bytes_by_source']}")
            finally:
                cl.stop(f"c{i}")
                cl.stop(f"d{i}")
                cl.stop(f"e{i}")
            path.unlink()
            settle(a, b)
            # The same push between two hosts that encrypt (--peer-encryption).
            xpath = ex.path / name
            ctx.scratch.warm(2 * size)
            ctx.io.write(xpath, size, MiB, fsync=True)
            cx, cy = cpu_seconds(ex.pid), cpu_seconds(ey.pid)
            wait_replicated(xpath)
            cpu["encrypted_sender"].append((cpu_seconds(ex.pid) - cx) / gib)
            cpu["encrypted_receiver"].append((cpu_seconds(ey.pid) - cy) / gib)
            t_enc = push_seconds(ex, name)
            settle(ex, ey)
            xpath.unlink()
            settle(ex, ey)
            return (mib_s(size, t_push), mib_s(size, t_close), mib_s(size, t_one),
                    mib_s(size, t_two), mib_s(size, t_pre), mib_s(size, t_enc))

        def theirs() -> float:
            ctx.scratch.warm(2 * size)
            return mib_s(size, sendfile_stream(ref_src, ref_dest))

        xs, ys = ctx.alternate(ours, theirs, label="bulk MiB/s (push, close->replica, "
                                                   "restore 1 holder, 2 holders, "
                                                   "prefetch 1 holder, encrypted push)")
    finally:
        ref_src.unlink(missing_ok=True)
        for name in list(cl.hosts):
            cl.stop(name)
    details["bulk"] = {"push_mib_s": [x[0] for x in xs], "close_to_replica_mib_s":
                       [x[1] for x in xs], "restore_one_holder_mib_s": [x[2] for x in xs],
                       "restore_two_holders_mib_s": [x[3] for x in xs],
                       "prefetch_one_holder_mib_s": [x[4] for x in xs],
                       "encrypted_push_mib_s": [x[5] for x in xs],
                       "sendfile_stream_mib_s": ys,
                       "cpu_s_per_gib": cpu}
    save_details(DETAILS, details)
    what = _size(size)
    ref = dict(ref=ys, ref_label="sendfile", note="reference: sendfile() stream between two "
               "Python processes on loopback, recv_into + pwrite into a huge-page tmpfs")
    med = {k: sorted(v)[len(v) // 2] for k, v in cpu.items() if v}

    def cpu_note(side_a: str, side_b: str, label_a: str, label_b: str) -> str:
        return (f"; CPU s/GiB (median): {label_a} {med.get(side_a, 0):.2f}, "
                f"{label_b} {med.get(side_b, 0):.2f}")

    push_ref = dict(ref, note=ref["note"] + cpu_note(
        "push_sender", "push_receiver", "sender (its seal pass too)", "receiver"))
    pre_ref = dict(ref, note=ref["note"] + cpu_note(
        "prefetch_holder", "prefetch_reader", "holder", "new host"))
    enc_ref = dict(ref, note=ref["note"] + cpu_note(
        "encrypted_sender", "encrypted_receiver", "sender (its seal pass too)", "receiver"))
    return [
        Row("bulk", f"replication of a closed {what} file: the push (daemon log)", "MiB/s",
            [x[0] for x in xs], min_ratio=0.7, **push_ref),
        Row("bulk", f"replication of a closed {what} file: close() to replicas >= 1", "MiB/s",
            [x[1] for x in xs], **ref),
        Row("bulk", f"restore read of {what} from one holder (empty RAM tier)", "MiB/s",
            [x[2] for x in xs], min_ratio=0.6, **ref),
        Row("bulk", f"restore read of {what} striped over two holders", "MiB/s",
            [x[3] for x in xs], **ref),
        Row("bulk", f"restore of {what} into RAM from one holder (mtcfs prefetch)", "MiB/s",
            [x[4] for x in xs], min_ratio=0.8, **pre_ref),
        Row("bulk", f"replication of a closed {what} file with --peer-encryption: the push",
            "MiB/s", [x[5] for x in xs], min_ratio=0.5, **enc_ref),
    ]


SHARDS = 8  # files of the replacement group's step


def wait_restored(m: Any, want: int, timeout: float = 300) -> dict[str, Any]:
    """The background restore's progress (`mtcfs status --json`) once it is done."""
    deadline = time.monotonic() + timeout
    while True:
        r = status(m)["restore"]
        if r["state"] == "done":
            if r["failed"] or r["bytes_done"] < want:
                raise BenchError(f"{m.path}: the background restore did not get it all: {r}")
            return r
        if time.monotonic() > deadline:
            raise BenchError(f"{m.path}: background restore not done after {timeout:.0f} s: {r}")
        time.sleep(0.01)


def replacement(ctx: Context) -> list[Row]:
    """A replacement host's background restore of a step of 4 x --size: host a wrote
    it (SHARDS files, then its commit marker; --replicas 1, so b holds a copy of each);
    per rep a's daemon is killed (-9) and a new one starts under its node id with an
    empty RAM dir, which restores the step from b before anything asks for it. Timed
    by the restore's own clock (`restore.seconds` in `mtcfs status --json`, from its
    first fetch to its last); CPU per GiB of both daemons from the replacement's start
    to the end."""
    size = 4 * ctx.size
    shard = size // SHARDS
    details: dict[str, Any] = {"size": size, "reps": ctx.reps, "code": code_version()}
    cl = Cluster(ctx)
    ref_src = ctx.ref_dir() / "sendfile-src"
    ctx.io.write(ref_src, ctx.size, MiB, fsync=True)
    ref_dest = ctx.scratch.huge_dir("ref") / "sendfile-dest"
    gib = size / (1 << 30)
    cpu: dict[str, list[float]] = {"holder": [], "replacement": []}
    walls: list[float] = []
    try:
        a = cl.start("a", ["b"])
        b = cl.start("b", ["a"])
        for m in (a, b):
            cl.wait_live(m, 1)
        step = a.path / "step_1"
        step.mkdir()
        ctx.scratch.warm(2 * size)  # a's shards and b's replicas
        names = [f"__{i}_0.distcp" for i in range(SHARDS)]
        for name in names:
            ctx.io.write(step / name, shard, MiB, fsync=True)
        (step / ".metadata").write_bytes(b"meta")  # the commit, last
        for name in names:
            wait_replicated(step / name)
        settle(a, b)
        err.print(f"  host a wrote {_size(size)} in {SHARDS} files, b holds a replica of "
                  f"each; a is replaced (empty RAM dir) per rep", style="dim")

        def ours() -> float:
            # Host a is lost (a clean unmount would tell b it left, with its copies).
            old = cl.hosts["a"]
            if old.pid is not None:
                os.kill(old.pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while process_alive(old.pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
            cl.stop("a")  # (detaches the dead mount, frees its RAM dir)
            ctx.scratch.warm(size)  # the replacement's copies
            cb = cpu_seconds(b.pid)
            t0 = time.monotonic()
            new = cl.start("a", ["b"])
            ca = cpu_seconds(new.pid)  # (its start-up before that is not counted)
            r = wait_restored(new, size)
            walls.append(time.monotonic() - t0)
            cpu["holder"].append((cpu_seconds(b.pid) - cb) / gib)
            cpu["replacement"].append((cpu_seconds(new.pid) - ca) / gib)
            for name in names:
                if state(new.path / "step_1" / name)["tiers"][0] != "ram":
                    raise BenchError(f"{name} is not in the replacement's RAM after its "
                                     f"restore: {state(new.path / 'step_1' / name)}")
            return mib_s(r["bytes_done"], r["seconds"])

        def theirs() -> float:
            ctx.scratch.warm(2 * ctx.size)
            return mib_s(ctx.size, sendfile_stream(ref_src, ref_dest))

        xs, ys = ctx.alternate(ours, theirs, label="background restore MiB/s")
    finally:
        ref_src.unlink(missing_ok=True)
        for name in list(cl.hosts):
            cl.stop(name)
    details["replacement"] = {"restore_mib_s": xs, "sendfile_stream_mib_s": ys,
                              "mount_to_restored_s": walls, "cpu_s_per_gib": cpu}
    save_details(BENCH_DIR / "results" / "replacement.json", details)
    med = {k: median(v) for k, v in cpu.items() if v}
    return [Row("replace", f"a replacement host's background restore of a {_size(size)} "
                f"step ({SHARDS} files) from one holder", "MiB/s", xs, ref=ys,
                ref_label="sendfile", min_ratio=0.7,
                note=f"reference: sendfile() stream of {_size(ctx.size)} between two Python "
                     f"processes on loopback into a huge-page tmpfs; CPU s/GiB (median): "
                     f"holder {med.get('holder', 0):.2f}, replacement "
                     f"{med.get('replacement', 0):.2f}")]


if __name__ == "__main__":  # pragma: no cover - a quick look without bench/run.py
    os.execv(sys.executable, [sys.executable, str(BENCH_DIR / "run.py"), "--only", "bulk",
                              *sys.argv[1:]])


# -- the channel's CPU budget per step -------------------------------------------------


def budget(ctx: Context) -> list[Row]:
    """CPU seconds per GiB of each step a block takes through the data channel, each
    alone in this process on 4 MiB buffers over a file of --size on a huge-page
    tmpfs (memory warmed first): what a push or a restore costs each side at least,
    before the kernel's socket copies (in the bulk group's per-side figures)."""
    import crc32c
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from mtcfs.peer.bulk import DATA, Sealer

    size = ctx.size
    block = 4 * MiB
    gib = size / (1 << 30)
    src = ctx.scratch.huge_dir("budget") / "src"
    ctx.io.write(src, size, MiB, fsync=True)
    buf = memoryview(bytearray(block + 16))
    out = memoryview(bytearray(block + 16))
    gmac = Sealer(AESGCM.generate_key(256), encrypt=False)
    enc = Sealer(AESGCM.generate_key(256), encrypt=True)
    fd = os.open(src, os.O_RDONLY)

    def each_block(fn: Any) -> float:
        t0 = time.process_time()
        for i, off in enumerate(range(0, size, block)):
            fn(i, off, min(block, size - off))
        return (time.process_time() - t0) / gib

    def read(i: int, off: int, n: int) -> None:
        os.preadv(fd, [buf[:n]], off)

    def pwrite_all(dest: Path) -> float:
        ctx.scratch.warm(size)
        wfd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(wfd, size)  # sized at once, as a replica's file
        try:
            return each_block(lambda i, off, n: os.pwrite(wfd, buf[:n], off))
        finally:
            os.close(wfd)
            dest.unlink()

    steps: dict[str, list[float]] = {k: [] for k in (
        "read", "gmac", "encrypt", "decrypt", "crc32c", "pwrite", "gmac_mapped",
        "crc32c_mapped")}
    mapped = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    try:
        for _ in range(ctx.reps):
            steps["read"].append(each_block(read))
            steps["gmac"].append(each_block(lambda i, off, n: gmac.seal(i, DATA, off, buf[:n])))
            # Where huge pages back the RAM tier, a block is tagged (sender) and
            # checksummed (the seal's pass) where it lies, through a mapping of its file.
            steps["gmac_mapped"].append(each_block(
                lambda i, off, n: gmac.seal(i, DATA, off, mapped[off:off + n])))
            steps["crc32c_mapped"].append(each_block(
                lambda i, off, n: crc32c.crc32c(mapped[off:off + n])))
            steps["encrypt"].append(each_block(
                lambda i, off, n: enc.seal(i, DATA, off, buf[:n], out)))
            tag, _ = enc.seal(0, DATA, 0, buf[:block], out)
            steps["decrypt"].append(each_block(
                lambda i, off, n, tag=tag: enc.open(0, DATA, 0, out[:block], tag, buf)))
            steps["crc32c"].append(each_block(lambda i, off, n: crc32c.crc32c(buf[:n])))
            steps["pwrite"].append(pwrite_all(src.parent / "dest"))
    finally:
        mapped.release()
        os.close(fd)
        src.unlink(missing_ok=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in steps.items()}
    sender = med["read"] + med["gmac"]
    receiver = med["gmac"] + med["crc32c"] + med["pwrite"]
    note = (f"per side without the kernel's socket copies: sender (read + tag) "
            f"{sender:.3f}, receiver (tag + crc32c + write) {receiver:.3f}; with "
            f"--peer-encryption sender {med['read'] + med['encrypt']:.3f}, receiver "
            f"{med['decrypt'] + med['crc32c'] + med['pwrite']:.3f}; where huge pages back "
            f"the RAM tier the sender tags a block where it lies, {med['gmac_mapped']:.3f}, "
            f"and the seal's pass checksums it there, {med['crc32c_mapped']:.3f}")
    what = {"read": "read a block into a buffer (preadv)",
            "gmac": "AES-GMAC tag of a block (default)",
            "encrypt": "AES-256-GCM encryption of a block (--peer-encryption)",
            "decrypt": "AES-256-GCM decryption and check of a block",
            "crc32c": "crc32c of a block (the receiver's check against the index)",
            "pwrite": "write a block into a replica's file (huge-page tmpfs, warmed)",
            "gmac_mapped": "AES-GMAC tag of a block where it lies (a mapping of the file)",
            "crc32c_mapped": "crc32c of a block where it lies (the seal's pass, mapped)"}
    return [Row("budget", f"data channel step: {what[k]}", "CPU s/GiB", v,
                higher_is_better=False, note=note if k == "crc32c_mapped" else "")
            for k, v in steps.items()]
