"""FUSE passthrough: reads and writes of files in the local RAM tier bypass the daemon.

What the kernel allows decides the cases here (fs/fuse/iomode.c): every open of an
inode is of one kind while any is open (passthrough with one backing file, or
through the daemon); passthrough needs CAP_SYS_ADMIN and no writeback cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import google_crc32c
import pytest

from mtcfs import control
from mtcfs.fs.passthrough import unavailable

from support.mounts import MtcfsMount, blob, mtcfs, wait_until

MiB = 1 << 20

pytestmark = pytest.mark.skipif(unavailable() is not None,
                                reason=f"no FUSE passthrough here: {unavailable()}")


@pytest.fixture
def data_path() -> str:
    return "passthrough"


def counts(m: MtcfsMount) -> dict:
    return m.status()["passthrough"]


def crc(data: bytes) -> str:
    return f"{google_crc32c.value(data):08x}"


def test_data_path_is_chosen_logged_and_shown(mnt):
    st = mnt.status()
    assert st["data_path"] == "passthrough" and st["passthrough"]["enabled"]
    assert mnt.log().count("data path: passthrough") == 1
    assert "passthrough" in mtcfs("status", str(mnt.path)).stdout


def test_reads_and_writes_bypass_the_daemon(mnt):
    data = blob(1, 64 * MiB + 3)
    before = counts(mnt)
    (mnt.path / "f").write_bytes(data)
    assert (mnt.path / "f").read_bytes() == data
    st = mnt.status()
    assert st["bytes_written"] == 0 and st["bytes_read"] == 0  # nothing passed the daemon
    assert st["passthrough"]["passthrough_opens"] >= before["passthrough_opens"] + 2
    assert mnt.state("f")["crc32c"] == crc(data)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").exists(),
                    reason="no transparent huge pages for tmpfs in this kernel")
def test_the_ram_tier_is_a_tmpfs_with_huge_pages_within_file_size(make_mount):
    """Its own tmpfs, huge=within_size: big files get 2 MiB pages (cheaper writes and
    reads), a small file is not rounded up to one, and bytes are bytes. (--huge-pages
    always: auto may turn them off on a VM that returns freed memory, as this one.)"""
    mnt = make_mount(extra=("--huge-pages", "always"))
    data_dir = str(mnt.ram_dir / "data")
    mounts = Path("/proc/mounts").read_text().splitlines()
    opts = [line.split()[3] for line in mounts if line.split()[1] == data_dir]
    assert opts and "huge=within_size" in opts[-1].split(","), opts
    small, big = blob(2, 5000), blob(3, 8 * MiB + 17)
    (mnt.path / "small").write_bytes(small)
    (mnt.path / "big").write_bytes(big)
    assert (mnt.path / "small").read_bytes() == small
    assert (mnt.path / "big").read_bytes() == big
    assert mnt.state("big")["crc32c"] == crc(big)
    ino = os.stat(mnt.path / "small").st_ino
    assert os.stat(mnt.ram_dir / "data" / str(ino)).st_blocks * 512 <= 8192


def test_close_marks_sealing_then_the_checksum_arrives(mnt):
    data = blob(2, 32 * MiB)
    with open(mnt.path / "f", "wb") as f:
        f.write(data)
        # Open for writing through passthrough: the daemon cannot see the writes.
        assert mnt.state("f", settle=False)["state"] == "open"
    states = {mnt.state("f", settle=False)["state"]}
    assert states <= {"sealing", "closed"}
    st = mnt.state("f")
    assert st["state"] == "closed" and st["size"] == len(data) and st["crc32c"] == crc(data)
    assert st["version"] == 1


def test_a_write_during_the_checksum_pass_of_the_last_close_is_sealed_too(mnt):
    """A file closed and, while the daemon's checksum pass over it runs (its release
    comes after close returns), opened again through passthrough and appended to,
    the handle open past the pass's end, then closed: the last close must seal the
    append too. (It did not: the first release's end cleared "written through
    passthrough" while the second writer was open, so its close sealed nothing and
    the file kept its old size and checksum, the appended bytes in no version: the
    POSIX model's rare "size 8 bytes short" with passthrough.)"""
    data = blob(3, 64 * MiB) * 4  # (a pass over 256 MiB takes a while)
    for i in range(4):
        name = f"race{i}"
        with open(mnt.path / name, "wb") as f:
            f.write(data)
        # Its release reached the daemon: the pass over it has begun.
        wait_until(lambda name=name: mnt.state(name, settle=False)["state"] != "open",
                   timeout=10)
        with open(mnt.path / name, "ab") as f:  # during the pass, open past its end
            f.write(b"8 bytes!")
            f.flush()
            time.sleep(0.5)
        st = mnt.state(name)
        assert st["state"] == "closed", st
        assert (st["size"], st["crc32c"]) == (len(data) + 8, crc(data + b"8 bytes!")), (i, st)
        assert os.stat(mnt.path / name).st_size == len(data) + 8
        os.unlink(mnt.path / name)


def test_concurrent_opens_of_one_file(mnt):
    """Reader, writer, O_APPEND and O_TRUNC opens of one file at the same time share
    one backing file; the kernel refuses none of them."""
    p = mnt.path / "f"
    p.write_bytes(b"0123456789")
    r = os.open(p, os.O_RDONLY)
    w = os.open(p, os.O_WRONLY)
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.pwrite(w, b"AB", 0)
        os.write(a, b"tail")
        assert os.pread(r, 100, 0) == b"AB23456789tail"
        t = os.open(p, os.O_RDWR | os.O_TRUNC)
        try:
            os.write(t, b"new")
            assert os.pread(r, 100, 0) == b"new"
            os.write(a, b"+")
            assert os.pread(r, 100, 0) == b"new+"
        finally:
            os.close(t)
    finally:
        for fd in (r, w, a):
            os.close(fd)
    st = mnt.state("f")
    assert st["state"] == "closed" and st["crc32c"] == crc(b"new+")
    assert counts(mnt)["backing_files"] == 0  # released at the last close


def test_a_write_open_that_changes_nothing_keeps_the_version(mnt):
    p = mnt.path / "f"
    p.write_bytes(b"content")
    v = mnt.state("f")["version"]
    with open(p, "r+b") as f:
        assert f.read() == b"content"
    assert mnt.state("f")["version"] == v


def test_close_after_fsync_does_not_checksum_again_unless_written(mnt):
    """close() of a file fsynced and not written since keeps the fsync's seal (no second
    pass on the close path); a write after the fsync, even one the same instant, is
    caught (the RAM file's ctime moved) and sealed at close."""
    data = blob(7, 32 * MiB)
    fd = os.open(mnt.path / "a", os.O_WRONLY | os.O_CREAT)
    os.write(fd, data)
    os.fsync(fd)
    seals = mnt.status()["seals"]
    os.close(fd)
    # One checksum after the fsync's: the release's (any mapping is gone then), not one
    # in close() as well.
    wait_until(lambda: mnt.status()["seals"] > seals, timeout=10, what="the release's seal")
    time.sleep(0.5)
    assert mnt.status()["seals"] == seals + 1
    st = mnt.state("a")
    assert st["crc32c"] == crc(data) and st["version"] == 1
    for i in range(20):  # a write right after the fsync's stat: never missed
        fd = os.open(mnt.path / f"b{i}", os.O_WRONLY | os.O_CREAT)
        os.write(fd, data[:MiB])
        os.fsync(fd)
        os.pwrite(fd, b"late", i)
        os.close(fd)
        want = data[:i] + b"late" + data[i + 4:MiB]
        assert (mnt.path / f"b{i}").read_bytes() == want
        assert mnt.state(f"b{i}")["crc32c"] == crc(want), i


def _mapped_then_closed(mnt, size: int) -> mmap.mmap:
    """A new file of `size` bytes, mapped shared and writable, its descriptor closed (the
    mapping keeps the file open)."""
    fd = os.open(mnt.path / "m", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    os.close(fd)
    return mm


def test_mmap_write_close_munmap_then_the_checksum_matches(mnt):
    """A shared writable mapping outlives close(): the file is checksummed when it is
    gone, never while its data can still change unseen."""
    size = 8 * MiB
    mm = _mapped_then_closed(mnt, size)
    mm[0:5] = b"hello"
    mm[size - 5:size] = b"world"
    time.sleep(0.2)
    mm[100:105] = b"later"  # still changes after close()
    mm.close()
    data = (mnt.path / "m").read_bytes()
    assert data[:5] == b"hello" and data[100:105] == b"later" and data[-5:] == b"world"
    st = mnt.state("m")
    assert st["state"] == "closed" and st["crc32c"] == crc(data)


def test_a_mapped_file_is_not_shown_closed_after_close(mnt):
    """A shared writable mapping outlives close(): the file stays `sealing` until the
    mapping goes. With passthrough the mapping still holds the mtcfs file (the kernel
    shows it in /proc/self/maps under the mount's device and inode), so the release,
    and the seal, come at munmap. (Once an xfail, about 1 run in 5, on older code;
    58 of 58 runs passed here on 2026-12-04, 38 of them beside two chaos runs.)"""
    mm = _mapped_then_closed(mnt, 8 * MiB)
    try:
        st = os.stat(mnt.path / "m")
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if line.rstrip().endswith("/m")]
        assert [(m[3], int(m[4])) for m in maps] == [(dev, st.st_ino)], maps
        mm[0:5] = b"hello"
        time.sleep(0.2)
        assert mnt.state("m", settle=False)["state"] != "closed"  # sealing at the earliest
    finally:
        mm.close()
    wait_until(lambda: mnt.state("m", settle=False)["state"] == "closed", timeout=10)


def _write_on(m, name: str, data: bytes) -> None:
    with open(m.path / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # returns once the peers have it in their index


def test_a_file_from_a_peer_is_read_in_ram_once_it_has_arrived(make_cluster):
    """Host b reads host a's file: b's open waits for the whole file (--open-wait) and
    the reader reads it through passthrough, not read by read through b's daemon."""
    c = make_cluster(2, replicas=0, extra=("--open-wait", "5"))
    a, b = c["a"], c["b"]
    data = blob(3, 96 * MiB)
    _write_on(a, "f", data)
    before = counts(b)
    assert (b.path / "f").read_bytes() == data
    after = counts(b)
    assert after["passthrough_opens"] == before["passthrough_opens"] + 1, (before, after)
    assert after["daemon_opens"] == before["daemon_opens"], (before, after)
    assert b.state("f")["tiers"][0] == "ram"


def test_an_open_waits_no_longer_than_open_wait(make_cluster):
    """The holder stalls (SIGSTOP): b's open gives up waiting after --open-wait and
    reads the file as it arrives, through b's daemon, once the holder goes on."""
    c = make_cluster(2, replicas=0, extra=("--open-wait", "1"))
    a, b = c["a"], c["b"]
    data = blob(4, 64 * MiB)
    _write_on(a, "f", data)
    before = counts(b)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        fd = os.open(b.path / "f", os.O_RDONLY)
        waited = time.monotonic() - t0
    finally:
        a.proc.send_signal(signal.SIGCONT)
    try:
        assert 0.9 <= waited < 4, waited
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    assert counts(b)["daemon_opens"] == before["daemon_opens"] + 1


def test_a_file_being_fetched_is_served_by_the_daemon_until_complete(make_cluster):
    """Host b reads host a's file as it arrives (--open-wait 0, the default): while it
    is fetched, b's opens go through b's daemon; once fetched and released, b's next
    open passes through."""
    c = make_cluster(2, replicas=0, extra=("--open-wait", "0"))
    a, b = c["a"], c["b"]
    data = blob(3, 96 * MiB)
    _write_on(a, "f", data)
    before = counts(b)
    fd = os.open(b.path / "f", os.O_RDONLY)  # starts the fetch
    try:
        assert os.pread(fd, 10, 0) == data[:10]
        fd2 = os.open(b.path / "f", os.O_RDONLY)  # joins the first open's kind
        assert os.pread(fd2, 10, len(data) - 10) == data[-10:]
        os.close(fd2)
    finally:
        os.close(fd)
    mid = counts(b)
    assert mid["daemon_opens"] >= before["daemon_opens"] + 2
    wait_until(lambda: b.state("f")["tiers"][0] == "ram", timeout=30)
    assert (b.path / "f").read_bytes() == data
    assert counts(b)["passthrough_opens"] > mid["passthrough_opens"]

def test_the_files_of_a_step_read_ahead_are_read_in_ram(make_cluster):
    """A load on b reads a's committed step file after file: its first open (the
    marker) starts the step's read-ahead, and each shard's open then waits for the
    shard whole (due well within STEP_OPEN_WAIT) and reads it through passthrough,
    not read by read through b's daemon while it arrives."""
    c = make_cluster(2, replicas=0)
    a, b = c["a"], c["b"]
    (a.path / "step_3").mkdir()
    shards = {f"step_3/__{i}_0.distcp": blob(40 + i, 24 * MiB + i) for i in range(3)}
    for rel, data in shards.items():
        _write_on(a, rel, data)
    _write_on(a, "step_3/.metadata", b"meta")  # the commit, last
    before = counts(b)
    assert (b.path / "step_3/.metadata").read_bytes() == b"meta"
    for rel, data in shards.items():
        assert (b.path / rel).read_bytes() == data
    after = counts(b)
    assert after["daemon_opens"] == before["daemon_opens"] + 1, (before, after)  # the marker
    assert after["passthrough_opens"] == before["passthrough_opens"] + len(shards), (
        before, after)
    assert all(b.state(rel)["tiers"][0] == "ram" for rel in shards)


def test_set_id_files_are_written_through_the_daemon(make_mount):
    """Their first unprivileged write must clear the bits: that write has to reach us."""
    m = make_mount(extra=("-o", "allow_other"))
    p = m.path / "f"
    p.write_bytes(b"x")
    os.chmod(p, 0o6777)
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    r = subprocess.run([python, "-c", "import os; fd = os.open('f', os.O_WRONLY); "
                        "os.write(fd, b'y')"], cwd=m.path, user=65534, group=65534,
                       extra_groups=[], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert os.stat(p).st_mode & 0o7777 == 0o777


def test_full_tier_enospc_and_writers_that_wait_for_room(make_mount, make_gcs_server):
    """The RAM tier is a tmpfs of --ram-size. Below a headroom, a new writer is served
    by the daemon and waits for room (uploads make data evictable); a passthrough
    writer that fills the tier gets ENOSPC from the kernel at once, and the daemon
    says the tier is full."""
    server = make_gcs_server("memory")
    bucket = server.create_bucket("pt-full")
    m = make_mount(ram_size="64MiB", extra=(
        "--bucket", f"gs://{bucket}", "--gcs-endpoint", server.url, "--persist", "on-close",
        "--full-timeout", "30"))
    # A passthrough writer running into the limit.
    with pytest.raises(OSError) as e, open(m.path / "huge", "wb") as f:
        for _ in range(80):
            f.write(b"\0" * MiB)
    assert e.value.errno == errno.ENOSPC
    # The daemon notices the full tier on its next look (it polls): while the file
    # still holds the space (once it is gone the tier may be free before that look).
    wait_until(lambda: m.status()["lifecycle"]["full_under_passthrough"] >= 1, timeout=10)
    os.unlink(m.path / "huge")
    # Its space comes back once the kernel has released its last handle (asynchronous).
    wait_until(lambda: m.status()["ram"]["free"] > 56 * MiB, timeout=10,
               what="the removed file's space back")
    assert "the RAM tier is full" in m.log()
    # The bucket goes away; unpersisted data fills the tier: nothing can be evicted yet.
    server.kill()
    for i in range(9):
        (m.path / f"q{i}").write_bytes(blob(20 + i, 6 * MiB))
    free = m.status()["ram"]["free"]
    assert free < 16 * MiB, free  # below the headroom: the next writer goes via the daemon
    before = counts(m)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; f = open(sys.argv[1], 'wb'); f.write(b'z' * (30 << 20)); f.close()"),
        str(m.path / "late")], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: counts(m)["daemon_opens"] > before["daemon_opens"], timeout=10)
        assert writer.poll() is None  # waiting for room
        server.start()  # uploads resume; persisted copies may go
        assert writer.wait(timeout=60) == 0, writer.stderr.read()
    finally:
        if writer.poll() is None:
            writer.kill()
    assert (m.path / "late").read_bytes() == b"z" * (30 << 20)


def test_kill9_with_files_open_through_passthrough(mnt):
    p = mnt.path
    (p / "closed").write_bytes(blob(5, 4 * MiB))
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "os.write(fd, b'a' * (1 << 20)); print('ready', flush=True)\n"
        "while True: os.write(fd, b'b' * 4096); time.sleep(0.01)\n"), str(p / "open")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        mnt.kill9()
    finally:
        writer.kill()
        writer.wait()
    mnt.start()
    assert mnt.state("open")["state"] == "incomplete"
    with pytest.raises(OSError) as e:
        (p / "open").read_bytes()
    assert e.value.errno == errno.EIO
    assert (p / "closed").read_bytes() == blob(5, 4 * MiB)
    assert mnt.state("closed")["crc32c"] == crc(blob(5, 4 * MiB))
    assert mnt.status()["data_path"] == "passthrough"


def test_auto_falls_back_to_fuse_without_cap_sys_admin(tmp_path, ram_root):
    """A daemon in a user namespace of its own has CAP_SYS_ADMIN there, not where the
    kernel looks for it: it cannot register backing files. `auto` serves through the
    daemon and says why; `passthrough` refuses to mount (exit 2, one line)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs unshare and nsenter (util-linux)")
    userns = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    mp = tmp_path / "m"
    mp.mkdir()
    r = subprocess.run([*userns, sys.executable, "-m", "mtcfs", "mount", str(mp), "--ram-dir",
                        str(ram_root / "r1"), "--data-path", "passthrough"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "CAP_SYS_ADMIN" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # auto: a daemon in its namespaces (the mount is visible inside them only).
    ram = ram_root / "r2"
    daemon = subprocess.Popen([*userns, sys.executable, "-m", "mtcfs", "mount", str(mp),
                               "--ram-dir", str(ram)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (ram / "daemon.json").exists() or daemon.poll() is not None,
                   timeout=30, what="the mount to be live")
        assert daemon.poll() is None, daemon.stderr.read()
        st = control.request_socket(str(ram / "control.sock"), "status")["status"]
        assert st["data_path"] == "fuse" and not st["passthrough"]["enabled"]
        err = daemon.stderr
        log = ""
        deadline = time.monotonic() + 5
        while "data path" not in log and time.monotonic() < deadline:
            log += err.readline()
        assert "data path: fuse (FUSE passthrough needs CAP_SYS_ADMIN in the initial user" \
            in log, log
        inside = subprocess.run(["nsenter", "-t", str(daemon.pid), "-U", "-m",
                                 "--preserve-credentials", "sh", "-c",
                                 f"echo works > {mp}/f && cat {mp}/f"],
                                capture_output=True, text=True, timeout=30)
        assert inside.stdout.strip() == "works", inside.stderr
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()


def test_sigterm_leaves_the_ram_tier_for_the_next_daemon(mnt):
    (mnt.path / "keep").write_bytes(b"kept")
    mnt.state("keep")
    os.kill(mnt.proc.pid, signal.SIGTERM)
    mnt.proc.wait(timeout=30)
    mnt.start()
    assert (mnt.path / "keep").read_bytes() == b"kept"
