"""Crash recovery: the daemon killed with -9 and started again on the same RAM
dir re-adopts every closed file (content, size, mode, xattrs, crc32c), never
serves a file that was being written as a good one, and drops the data of
files that were unlinked while open. Also: write() does not touch the
metadata database."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import select
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from mtcfs import control
from mtcfs.config import mount_entry

from support.mounts import BOTH_DATA_PATHS, data_files, wait_until


@pytest.fixture(params=BOTH_DATA_PATHS)
def data_path(request: pytest.FixtureRequest) -> str:
    """Every test here runs with passthrough and with every byte through the daemon."""
    return request.param

MiB = 1 << 20


# -- helpers ---------------------------------------------------------------------


def chunks(seed: int, size: int, chunk: int = MiB):
    """Deterministic pseudo-random content, generated piece by piece."""
    rng = np.random.default_rng(seed)
    off = 0
    while off < size:
        n = min(chunk, size - off)
        yield rng.bytes(n)
        off += n


class Tree:
    """What the mount should hold: files (content digests, modes, xattrs,
    versions), directories and symlinks, checked against the mount."""

    def __init__(self, mnt) -> None:
        self.mnt = mnt
        self.files: dict[str, dict] = {}
        self.dirs: dict[str, dict] = {"": {"mode": None, "xattrs": {}}}
        self.links: dict[str, str] = {}

    def p(self, rel: str) -> Path:
        return self.mnt.path / rel

    def mkdir(self, rel: str, mode: int = 0o755, xattrs: dict | None = None) -> None:
        os.mkdir(self.p(rel))
        os.chmod(self.p(rel), mode)
        for k, v in (xattrs or {}).items():
            os.setxattr(self.p(rel), k, v)
        self.dirs[rel] = {"mode": mode, "xattrs": dict(xattrs or {})}

    def symlink(self, rel: str, target: str) -> None:
        os.symlink(target, self.p(rel))
        self.links[rel] = target

    def write(self, rel: str, seed: int, size: int, mode: int = 0o644,
              xattrs: dict | None = None, order: str = "seq", block: int = MiB) -> None:
        """Write a file sequentially or in random order (pwrite), close it,
        and record what it must look like."""
        sha, crc = hashlib.sha256(), 0
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if order == "seq":
                for piece in chunks(seed, size, block):
                    os.write(fd, piece)
                    sha.update(piece)
                    crc = google_crc32c.extend(crc, piece)
            else:
                data = b"".join(chunks(seed, size))
                offsets = list(range(0, size, block))
                random.Random(seed).shuffle(offsets)
                for off in offsets:
                    os.pwrite(fd, data[off:off + block], off)
                for off in offsets[: len(offsets) // 4]:  # overwrite some, same bytes
                    os.pwrite(fd, data[off:off + block // 2], off)
                sha.update(data)
                crc = google_crc32c.value(data)
        finally:
            os.close(fd)
        os.chmod(self.p(rel), mode)
        for k, v in (xattrs or {}).items():
            os.setxattr(self.p(rel), k, v)
        st = self.mnt.state(rel)
        assert st["state"] == "closed" and st["size"] == size, st
        assert st["crc32c"] == f"{crc:08x}", (rel, st)
        self.files[rel] = {"size": size, "sha": sha.hexdigest(), "crc": f"{crc:08x}",
                           "mode": mode, "xattrs": dict(xattrs or {}), "version": st["version"],
                           "mtime": os.stat(self.p(rel)).st_mtime_ns}

    def remove(self, rel: str) -> None:
        os.unlink(self.p(rel))
        del self.files[rel]

    def rename(self, old: str, new: str) -> None:
        os.rename(self.p(old), self.p(new))
        self.files[new] = self.files.pop(old)

    def check(self) -> None:
        found = set()
        for dirpath, dirnames, filenames in os.walk(self.mnt.path):
            rel_dir = os.path.relpath(dirpath, self.mnt.path)
            rel_dir = "" if rel_dir == "." else rel_dir
            found.add(("d", rel_dir))
            for n in dirnames + filenames:
                rel = os.path.join(rel_dir, n)
                if os.path.islink(self.p(rel)):
                    found.add(("l", rel))
                elif n in filenames:
                    found.add(("f", rel))
        expected = ({("d", d) for d in self.dirs} | {("f", f) for f in self.files}
                    | {("l", link) for link in self.links})
        assert found == expected
        for rel, d in self.dirs.items():
            st = os.stat(self.p(rel))
            assert stat.S_ISDIR(st.st_mode)
            if d["mode"] is not None:
                assert stat.S_IMODE(st.st_mode) == d["mode"], rel
            assert self.xattrs(rel) == d["xattrs"], rel
        for rel, target in self.links.items():
            assert os.readlink(self.p(rel)) == target
        for rel, f in self.files.items():
            st = os.stat(self.p(rel))
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == f["mode"], rel
            assert st.st_size == f["size"], rel
            assert st.st_mtime_ns == f["mtime"], rel
            assert self.xattrs(rel) == f["xattrs"], rel
            state = self.mnt.state(rel)
            assert state["state"] == "closed", (rel, state)
            assert state["size"] == f["size"] and state["crc32c"] == f["crc"], (rel, state)
            assert state["version"] == f["version"], (rel, state)
            sha, crc = hashlib.sha256(), 0
            with open(self.p(rel), "rb") as fh:
                while piece := fh.read(8 * MiB):
                    sha.update(piece)
                    crc = google_crc32c.extend(crc, piece)
            assert sha.hexdigest() == f["sha"], f"{rel}: content differs"
            assert f"{crc:08x}" == f["crc"]

    def xattrs(self, rel: str) -> dict:
        return {n: os.getxattr(self.p(rel), n) for n in os.listxattr(self.p(rel))}


def crash_and_restart(mnt) -> None:
    """kill -9, check that the mount is dead, start a daemon on the same RAM dir
    and mountpoint (it must clean up the dead mount by itself)."""
    mnt.kill9()
    # (stat() of the mount root may still be answered from the attribute cache.)
    for call in (os.listdir, os.statvfs):
        with pytest.raises(OSError) as e:
            call(mnt.path)
        assert e.value.errno == errno.ENOTCONN
    mnt.start()
    assert mnt.status()["health"] == "ok"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    assert points.count(str(mnt.path)) == 1, "the dead mount was not cleaned up"


def build_tree(mnt, big: int = 200 * MiB) -> Tree:
    t = Tree(mnt)
    t.write("big.bin", seed=1, size=big)  # sequential, 1 MiB writes
    t.write("scattered.bin", seed=2, size=24 * MiB + 777, order="random", block=64 << 10)
    t.mkdir("step_100", 0o750, {"user.step": b"100"})
    t.mkdir("step_100/model", 0o700)
    t.mkdir("step_100/model/deep", 0o755, {"user.empty": b""})
    t.write("step_100/model/shard_0.distcp", seed=3, size=3 * MiB + 5, mode=0o640,
            xattrs={"user.rank": b"0", "user.bin": bytes(range(256))})
    t.write("step_100/model/shard_1.distcp", seed=4, size=MiB, mode=0o600,
            order="random", block=4096)
    t.write("step_100/model/deep/empty", seed=5, size=0, mode=0o444)
    t.write("step_100/.metadata.tmp", seed=6, size=12345, mode=0o644)
    t.rename("step_100/.metadata.tmp", "step_100/.metadata")  # the DCP commit
    t.write("step_100/rewritten", seed=7, size=2 * MiB)
    t.write("step_100/rewritten", seed=8, size=MiB + 1)  # a second version
    assert t.files["step_100/rewritten"]["version"] >= 2
    t.symlink("latest", "step_100")
    return t


# -- (a) crash after writes -------------------------------------------------------


def test_kill9_after_writes_keeps_closed_files(mnt):
    t = build_tree(mnt)
    t.check()
    before = mnt.status()
    crash_and_restart(mnt)
    t.check()
    after = mnt.status()
    assert after["files"] == before["files"] == len(t.files)
    assert after["states"] == {"closed": len(t.files)}
    assert after["ram"]["used"] == before["ram"]["used"]
    # Still fully usable: new files, and the old ones can be rewritten.
    t.write("after.bin", seed=9, size=5 * MiB)
    t.write("big.bin", seed=10, size=3 * MiB)
    t.check()


# -- (b) crash during writes ------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, sys, time
    new1, new2, existing = sys.argv[1:4]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fds = [os.open(new1, flags, 0o644), os.open(new2, flags, 0o644),
           os.open(existing, os.O_RDWR)]
    buf = os.urandom(1 << 20)
    n = 0
    while True:
        for fd in fds:
            os.pwrite(fd, buf, n << 20)
        n += 1
        if n == 6:
            for fd in fds:
                os.fsync(fd)  # the daemon has seen writes to each of them
            print("ready", flush=True)
        time.sleep(0.005)
""")


def test_kill9_during_writes(mnt):
    t = Tree(mnt)
    t.mkdir("done")
    t.write("done/a.bin", seed=1, size=8 * MiB, mode=0o640, xattrs={"user.x": b"1"})
    t.write("done/b.bin", seed=2, size=3 * MiB, order="random", block=8192)
    t.write("victim.bin", seed=3, size=4 * MiB)  # closed, then reopened and changed
    writing = ["new1.bin", "new2.bin", "victim.bin"]
    reader = -1
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, *(str(mnt.path / n) for n in writing)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready, _, _ = select.select([writer.stdout], [], [], 60)
        assert ready, "the writer did not start"
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        # fsync sealed each as a version; the writes that follow open it again (with
        # passthrough the daemon does not see them: wait until they are in the file).
        for name in ("new1.bin", "victim.bin"):
            wait_until(lambda name=name: mnt.state(name)["state"] == "open"
                       and os.stat(mnt.path / name).st_size > 6 * MiB, timeout=10)
        reader = os.open(mnt.path / "done" / "a.bin", os.O_RDONLY)  # open, not written
        assert len(os.pread(reader, MiB, 0)) == MiB
        mnt.kill9()
    finally:
        writer.kill()
        writer.wait()
        if reader >= 0:
            with contextlib.suppress(OSError):
                os.close(reader)
    del t.files["victim.bin"]
    mnt.start()

    for name in writing:
        st = mnt.state(name)
        assert st["state"] == "incomplete", (name, st)
        assert st["crc32c"] is None and st["holders"] == [], st
        for flags in (os.O_RDONLY, os.O_RDWR):  # never served, never silently appended to
            with pytest.raises(OSError) as e:
                os.close(os.open(mnt.path / name, flags))
            assert e.value.errno == errno.EIO, (name, flags)
    status = mnt.status()
    assert status["states"] == {"closed": 2, "incomplete": 3}
    # Closed before the crash: intact.
    incomplete = {n: mnt.state(n) for n in writing}
    _check_closed_only(t, set(writing))

    # Keeping part of it is refused; renaming or chmod keeps it incomplete.
    for size in (5, 6 * MiB, 100 * MiB):
        with pytest.raises(OSError) as e:
            os.truncate(mnt.path / "new1.bin", size)
        assert e.value.errno == errno.EIO
    os.rename(mnt.path / "new1.bin", mnt.path / "renamed.bin")
    os.chmod(mnt.path / "renamed.bin", 0o600)
    assert mnt.state("renamed.bin")["state"] == "incomplete"

    # Recovery: remove one, truncate one to 0, rewrite the others with O_TRUNC.
    os.unlink(mnt.path / "renamed.bin")
    assert not (mnt.path / "renamed.bin").exists()
    os.truncate(mnt.path / "new2.bin", 0)
    st = mnt.state("new2.bin")
    assert st["state"] == "closed" and st["size"] == 0 and st["crc32c"] == "00000000"
    assert (mnt.path / "new2.bin").read_bytes() == b""
    data = os.urandom(2 * MiB + 3)
    for name in ("new2.bin", "victim.bin"):
        fd = os.open(mnt.path / name, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        st = mnt.state(name)
        assert st["state"] == "closed" and st["size"] == len(data), st
        assert st["crc32c"] == f"{google_crc32c.value(data):08x}"
        assert st["version"] > incomplete[name]["version"]
        assert (mnt.path / name).read_bytes() == data
    assert mnt.status()["states"] == {"closed": 4}


def _check_closed_only(t: Tree, skip: set[str]) -> None:
    for rel in skip:
        assert rel not in t.files
    for rel, f in t.files.items():
        st = t.mnt.state(rel)
        assert st["state"] == "closed" and st["crc32c"] == f["crc"], (rel, st)
        data = (t.mnt.path / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha"]
        assert stat.S_IMODE(os.stat(t.mnt.path / rel).st_mode) == f["mode"]
        assert t.xattrs(rel) == f["xattrs"]


# -- (c) unlinked while open, then a crash --------------------------------------------


def test_kill9_after_unlink_while_open_drops_orphan(mnt):
    (mnt.path / "keep").write_bytes(b"k" * 1000)
    old = b"".join(chunks(2, 16 * MiB))
    (mnt.path / "replaced").write_bytes(old)
    fd = os.open(mnt.path / "orphan", os.O_RDWR | os.O_CREAT, 0o644)
    rfd = os.open(mnt.path / "replaced", os.O_RDONLY)
    try:
        for piece in chunks(1, 64 * MiB):
            os.write(fd, piece)
        os.fsync(fd)
        os.unlink(mnt.path / "orphan")
        assert not (mnt.path / "orphan").exists()
        assert os.pread(fd, 4, 0) == next(chunks(1, 4))  # still readable through the fd
        # Replaced by a rename while open: the old inode is an orphan too.
        (mnt.path / "newer").write_bytes(b"n" * 10)
        os.rename(mnt.path / "newer", mnt.path / "replaced")
        assert os.pread(rfd, 16, MiB) == old[MiB:MiB + 16]
        st = mnt.status()
        assert st["ram"]["used"] >= 80 * MiB
        assert len(data_files(mnt.ram_dir)) == 4
        mnt.kill9()
    finally:
        for f in (fd, rfd):
            with contextlib.suppress(OSError):
                os.close(f)
    mnt.start()
    st = mnt.status()
    assert st["files"] == 2 and st["states"] == {"closed": 2}
    assert st["ram"]["used"] < MiB
    assert len(data_files(mnt.ram_dir)) == 2
    assert sorted(os.listdir(mnt.path)) == ["keep", "replaced"]
    assert (mnt.path / "keep").read_bytes() == b"k" * 1000
    assert (mnt.path / "replaced").read_bytes() == b"n" * 10
    assert mnt.state("replaced")["crc32c"] == f"{google_crc32c.value(b'n' * 10):08x}"


# -- (d) repeated crashes -----------------------------------------------------------


def test_repeated_kill9_cycles(mnt):
    t = Tree(mnt)
    for cycle in range(3):
        d = f"c{cycle}"
        t.mkdir(d, 0o750 + cycle, {"user.cycle": str(cycle).encode()})
        t.write(f"{d}/seq", seed=10 * cycle + 1, size=(8 + cycle) * MiB + cycle,
                mode=0o640)
        t.write(f"{d}/random", seed=10 * cycle + 2, size=2 * MiB, order="random",
                block=16 << 10, xattrs={"user.c": bytes([cycle])})
        t.write(f"{d}/small", seed=10 * cycle + 3, size=100 + cycle, mode=0o600)
        if cycle:
            prev = f"c{cycle - 1}"
            t.rename(f"{prev}/small", f"{d}/moved-from-{prev}")
            t.remove(f"{prev}/random")
            t.write(f"{prev}/seq", seed=10 * cycle + 4, size=MiB, mode=0o644)
        t.check()
        crash_and_restart(mnt)
        t.check()
    assert mnt.status()["states"] == {"closed": len(t.files)}


# -- write() does not touch the metadata database ------------------------------------


def test_writes_do_not_touch_metadata_db(mnt):
    """Only namespace changes and seals reach meta.db: a 256 MiB file written
    with 1 MiB writes inside ONE open leaves meta.db and its WAL untouched
    between open and close, while the daemon receives the data."""
    db = [mnt.ram_dir / "meta.db", mnt.ram_dir / "meta.db-wal"]

    def snap() -> list[tuple[int, int]]:
        return [(p.stat().st_size, p.stat().st_mtime_ns) for p in db]

    def received() -> int:
        # In this process: a subprocess (fork + exec) would close a copy of the
        # open fd, and that close() is a FUSE flush, which seals the file.
        return control.request(str(mnt.path), "status")["status"]["bytes_written"]

    piece = os.urandom(MiB)
    total = 256 * MiB
    passthrough = mnt.status()["data_path"] == "passthrough"
    fd = os.open(mnt.path / "big", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, piece)
        time.sleep(0.05)  # any metadata the open caused is written by now
        before = snap()
        received0 = received()
        for _ in range(total // MiB - 1):
            os.write(fd, piece)
        # The kernel writes back while we write; wait until the daemon has most of it
        # (with passthrough the writes never reach it: the RAM file has them).
        deadline = time.monotonic() + 20
        while not passthrough and received() - received0 < total // 2:
            assert time.monotonic() < deadline, "the daemon did not receive the writes"
            time.sleep(0.05)
        got = received() - received0
        if passthrough:
            assert got == 0 and os.path.getsize(data_files(mnt.ram_dir)[0]) == total
        after = snap()
        assert after == before, f"meta.db changed during {got} bytes of writes"
    finally:
        os.close(fd)
    st = mnt.state("big")
    assert st["state"] == "closed" and st["size"] == total
    assert st["crc32c"] == f"{google_crc32c.value(piece * (total // MiB)):08x}"
    status = mnt.status()
    # Sequential: the crc32c was streamed, no pass over the data at seal time (with
    # passthrough: one pass, from the RAM file, after the close).
    assert status["seal_full_passes"] == (1 if passthrough else 0) and status["seals"] == 1
    assert snap() != before  # the seal itself is recorded
    assert mount_entry(str(mnt.path)) is not None
