"""The patched pyfuse3's FUSE passthrough (scripts/patches/pyfuse3-passthrough.patch).

A tiny pyfuse3 file system (tests/support/passthrough_fs.py, a subprocess) backs its
files with files on tmpfs and opens them with a backing id: reads, writes and
mmap then go to the backing file without READ/WRITE requests to the daemon.

What the kernel (fs/fuse/iomode.c; seen on 6.18) does with mixed opens of one
inode, as the caller of open(2) sees it: while a file is open in passthrough
mode, any other open of it that is not a passthrough open with the same
backing id fails with EIO: page-cache opens, direct_io opens and passthrough
opens with another backing file alike (the daemon still gets a RELEASE for
the refused open). While it is open through the page cache, a passthrough
open fails with EIO; while it is open with direct_io only, a passthrough open
succeeds and both see the same data.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs.config import mount_entry

from support.mounts import blob, crc_of, force_unmount, wait_until

pyfuse3 = pytest.importorskip("pyfuse3")
if not hasattr(pyfuse3, "backing_open"):
    pytest.skip("pyfuse3 without the passthrough patch (scripts/build_pyfuse3.sh did not run "
                "or fell back to stock pyfuse3)", allow_module_level=True)

FS = Path(__file__).parent / "support" / "passthrough_fs.py"
MiB = 1 << 20


class PtFs:
    """One tests/support/passthrough_fs.py daemon and its mount."""

    def __init__(self, mountpoint: Path, backing: Path, passthrough: bool = True) -> None:
        self.path = mountpoint
        self.backing = backing
        self.log_path = backing.parent / f"{backing.name}.log"
        args = [] if passthrough else ["--no-passthrough"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(FS), str(mountpoint), str(backing),
                                          *args], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"passthrough_fs exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            if mount_entry(str(mountpoint)) is not None:
                try:
                    self.stats()
                    break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mount did not come up:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.ptfs.stats"))

    def probe(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.ptfs.probe"))

    def requests(self, name: str, *ops: str) -> int:
        counts = self.stats()["ops"]
        return sum(counts.get(f"{op}:{name}", 0) for op in ops)

    def set_mode(self, name: str, mode: str) -> None:
        os.setxattr(self.path / name, "user.ptfs.mode", mode.encode())

    def no_live_backing_ids(self) -> bool:
        return not self.stats()["live_backing_ids"]

    def stop(self) -> None:
        force_unmount(str(self.path))
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def make_ptfs(tmp_path: Path, ram_root: Path) -> Iterator:
    mounts: list[PtFs] = []

    def make(name: str = "a", passthrough: bool = True) -> PtFs:
        mp = tmp_path / f"mnt-{name}"
        mp.mkdir()
        backing = ram_root / f"backing-{name}"
        backing.mkdir()
        fs = PtFs(mp, backing, passthrough)
        mounts.append(fs)
        return fs

    yield make
    for fs in mounts:
        fs.stop()
        if fs.proc.returncode not in (0, None):
            print(fs.log())


@pytest.fixture
def ptfs(make_ptfs) -> PtFs:
    """A mount with passthrough negotiated (skips if the kernel cannot)."""
    fs = make_ptfs()
    if not fs.stats()["passthrough_enabled"]:
        pytest.skip("the kernel did not offer FUSE passthrough (Linux >= 6.9 with "
                    "CONFIG_FUSE_PASSTHROUGH)")
    return fs


def test_data_goes_to_the_backing_file_without_read_write_requests(ptfs: PtFs) -> None:
    # A 64 MiB file, written in 1 MiB writes and read back.
    data = blob(1, 64 * MiB)
    with open(ptfs.path / "big", "wb") as f:
        for off in range(0, len(data), MiB):
            f.write(data[off:off + MiB])
        assert list(ptfs.stats()["live_backing_ids"]) == ["big"]
    assert crc_of((ptfs.backing / "big").read_bytes()) == crc_of(data)
    assert os.stat(ptfs.path / "big").st_size == len(data)
    assert crc_of((ptfs.path / "big").read_bytes()) == crc_of(data)

    # O_APPEND writes land at the end of the backing file.
    (ptfs.path / "log").write_bytes(b"start\n")
    with open(ptfs.path / "log", "ab") as f:
        for i in range(100):
            f.write(b"line %d\n" % i)
    want = b"start\n" + b"".join(b"line %d\n" % i for i in range(100))
    assert (ptfs.backing / "log").read_bytes() == want
    assert (ptfs.path / "log").read_bytes() == want

    # 4 KiB writes: with KILLPRIV_V2 not even a GETXATTR(security.capability)
    # request per write() (without it, one each).
    with open(ptfs.path / "small", "wb") as f:
        for i in range(1000):
            f.write(data[i * 4096:(i + 1) * 4096])
    assert (ptfs.backing / "small").read_bytes() == data[:4096000]
    assert ptfs.requests("small", "getxattr") <= 2

    # A shared mmap write (through the backing file's page cache).
    (ptfs.path / "mapped").write_bytes(bytes(3 * MiB))
    with open(ptfs.path / "mapped", "r+b") as f, mmap.mmap(f.fileno(), 3 * MiB) as m:
        m[MiB:MiB + 11] = b"mmap write!"
        m[-4:] = b"tail"
        m.flush()
        assert m[:4] == bytes(4)
    backing = (ptfs.backing / "mapped").read_bytes()
    assert backing[MiB:MiB + 11] == b"mmap write!" and backing[-4:] == b"tail"
    assert len(backing) == 3 * MiB and backing.count(0) == 3 * MiB - 15

    # Data written to the backing file directly is what the mount reads.
    (ptfs.backing / "log").write_bytes(b"replaced")
    assert (ptfs.path / "log").read_bytes() == b"replaced"

    # Not a single READ or WRITE request reached the daemon for these files,
    # and every backing id was released with the last close.
    for name in ("big", "log", "small", "mapped"):
        assert ptfs.requests(name, "read", "write") == 0, (name, ptfs.stats())
    stats = ptfs.stats()
    assert list(stats["opens"]) == ["passthrough"] and stats["backing_errors"] == []
    wait_until(ptfs.no_live_backing_ids, timeout=10, what="the backing ids' release")

    # The counters do count: the same file opened without passthrough.
    ptfs.set_mode("big", "cached")
    assert crc_of((ptfs.path / "big").read_bytes()) == crc_of(data)
    with open(ptfs.path / "big", "r+b") as f:
        f.write(b"through the daemon")
    assert ptfs.requests("big", "read") > 0 and ptfs.requests("big", "write") > 0
    assert (ptfs.backing / "big").read_bytes()[:18] == b"through the daemon"


def test_backing_calls_fail_cleanly(ptfs: PtFs, make_ptfs) -> None:
    probe = ptfs.probe()
    assert probe["close_unknown"]["errno"] == "ENOENT"
    assert probe["close_zero"]["errno"] == "EINVAL"
    assert probe["open_bad_fd"]["errno"] == "EBADF"
    assert probe["open_directory"]["errno"] == "EISDIR"
    assert probe["open_pipe"]["errno"] == "EINVAL"
    assert probe["open_file"]["ok"] > 0
    assert probe["close_file"] == {"ok": None}
    assert probe["close_file_again"]["errno"] == "ENOENT"
    assert "No such file or directory" in probe["close_unknown"]["message"]

    # The Operations class does not ask for passthrough: backing_open fails
    # with EPERM and says why; the file system falls back to ordinary opens.
    plain = make_ptfs("plain", passthrough=False)
    assert plain.stats()["passthrough_enabled"] is False
    (plain.path / "f").write_bytes(b"x" * 10000)
    assert (plain.path / "f").read_bytes() == b"x" * 10000
    stats = plain.stats()
    assert stats["backing_errors"][0] == {
        "errno": "EPERM",
        "message": "[Errno 1] Operation not permitted (FUSE passthrough was not negotiated)"}
    assert stats["opens"] == {"cached": 2}
    assert plain.requests("f", "write") > 0 and plain.requests("f", "read") > 0
    probe = plain.probe()
    assert probe["open_file"]["errno"] == "EPERM"
    assert probe["close_unknown"]["errno"] == "EPERM"


def open_errno(path: Path, flags: int = os.O_RDWR) -> int:
    """0 if open(2) succeeds (the fd is closed again), else its errno."""
    try:
        os.close(os.open(path, flags))
        return 0
    except OSError as e:
        return e.errno


def test_mixed_opens_of_one_inode(ptfs: PtFs) -> None:
    f = ptfs.path / "f"
    f.write_bytes(b"0123456789")
    fd = os.open(f, os.O_RDWR)  # passthrough
    try:
        for mode in ("cached", "direct", "new-backing"):
            ptfs.set_mode("f", mode)
            assert open_errno(f) == errno.EIO, mode
            assert open_errno(f, os.O_RDONLY) == errno.EIO, mode
        ptfs.set_mode("f", "passthrough")
        assert open_errno(f, os.O_RDONLY) == 0  # the same backing id: fine
    finally:
        os.close(fd)
    wait_until(ptfs.no_live_backing_ids, timeout=10, what="the backing id's release")
    assert ptfs.requests("f", "read", "write") == 0
    # The kernel sent a RELEASE for each refused open, too.
    assert ptfs.requests("f", "open", "create") == 9
    wait_until(lambda: ptfs.requests("f", "release") == 9, timeout=10, what="the releases")

    # The other way round: while the file is open through the page cache, a
    # passthrough open is refused; while it is open with direct_io, it is not.
    ptfs.set_mode("f", "cached")
    fd = os.open(f, os.O_RDWR)
    try:
        ptfs.set_mode("f", "passthrough")
        assert open_errno(f) == errno.EIO
    finally:
        os.close(fd)
    ptfs.set_mode("f", "direct")
    dfd = os.open(f, os.O_RDWR)
    try:
        ptfs.set_mode("f", "passthrough")
        fd = os.open(f, os.O_RDWR)
        try:
            assert os.pwrite(dfd, b"DIRECT", 0) == 6
            assert os.pread(fd, 10, 0) == b"DIRECT6789"
            assert os.pwrite(fd, b"PT", 8) == 2
            assert os.pread(dfd, 10, 0) == b"DIRECT67PT"
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    # Only the direct_io open's I/O went through the daemon.
    assert ptfs.requests("f", "write") == 1 and ptfs.requests("f", "read") == 1
    assert (ptfs.backing / "f").read_bytes() == b"DIRECT67PT"
