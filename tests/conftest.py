"""Shared fixtures: real mtcfs daemons as subprocesses with real FUSE mounts.

The daemon is never run in the test process: a blocking call on a mount from
the thread that serves it would deadlock. Every fixture cleans up its mounts,
processes and RAM dirs, also when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtcfs.config import mount_entry

MTCFS = [sys.executable, "-m", "mtcfs"]


def mtcfs(*args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([*MTCFS, *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


def force_unmount(path: str) -> None:
    for _ in range(3):
        if mount_entry(path) is None:
            return
        subprocess.run(["fusermount3", "-uz", path], capture_output=True)
        if mount_entry(path) is not None:
            subprocess.run(["umount", "-l", path], capture_output=True)


class MtcfsMount:
    """One mtcfs daemon (foreground subprocess) and its mount."""

    def __init__(self, mountpoint: Path, ram_dir: Path, ram_size: str = "2GiB",
                 node_id: str = "node-a", extra: tuple[str, ...] = ()) -> None:
        self.path = mountpoint
        self.ram_dir = ram_dir
        self.ram_size = ram_size
        self.node_id = node_id
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.log_path = ram_dir.parent / f"{ram_dir.name}.log"

    def start(self, timeout: float = 20) -> MtcfsMount:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*MTCFS, "mount", str(self.path), "--ram-dir", str(self.ram_dir), "--ram-size",
                 self.ram_size, "--node-id", self.node_id, "--log-level", "debug", *self.extra],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mtcfs exited with {self.proc.returncode}:\n{self.log()}")
            if mount_entry(str(self.path)) is not None:
                try:
                    os.getxattr(self.path, "user.mtcfs.control")
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"mount did not come up:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except FileNotFoundError:
            return ""

    def status(self) -> dict:
        r = mtcfs("status", str(self.path), "--json", check=True)
        return json.loads(r.stdout)

    def state(self, rel: str) -> dict:
        return json.loads(os.getxattr(self.path / rel, "user.mtcfs.state"))

    def kill9(self) -> None:
        """Crash the daemon: the mount is left dead (ENOTCONN) as in real life."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            r = mtcfs("umount", str(self.path))
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if r.returncode != 0 and mount_entry(str(self.path)) is not None:
                force_unmount(str(self.path))
        force_unmount(str(self.path))

    def restart(self) -> MtcfsMount:
        self.stop()
        return self.start()


@pytest.fixture
def ram_root() -> Iterator[Path]:
    """A directory on tmpfs for RAM dirs (and reference trees), removed afterwards."""
    root = Path("/dev/shm") / f"mtcfs-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_mount(tmp_path: Path, ram_root: Path) -> Iterator:
    mounts: list[MtcfsMount] = []

    def make(name: str = "a", ram_size: str = "2GiB", extra: tuple[str, ...] = (),
             start: bool = True) -> MtcfsMount:
        mp = tmp_path / f"mnt-{name}"
        mp.mkdir(exist_ok=True)
        m = MtcfsMount(mp, ram_root / f"ram-{name}", ram_size, f"node-{name}", extra)
        mounts.append(m)
        return m.start() if start else m

    yield make
    for m in mounts:
        try:
            m.stop()
        finally:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
            force_unmount(str(m.path))


@pytest.fixture
def mnt(make_mount) -> MtcfsMount:
    """A started mtcfs mount with a 2 GiB RAM tier."""
    return make_mount()


# -- GCS server (fake-gcs-server) for durable-tier tests -----------------------------------------
# Appended section (other engineers append fixtures too), hence the late import.

import gcs_server as _gcs  # noqa: E402


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[_gcs.GcsServer]:
    """One fake-gcs-server (memory backend) for the session; tests make their own buckets.

    Tests that kill or corrupt a server use make_gcs_server instead.
    """
    server = _gcs.GcsServer(backend="memory").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(gcs_server: _gcs.GcsServer) -> str:
    """A fresh, empty bucket on the session server."""
    if gcs_server.proc is None or gcs_server.proc.poll() is not None:
        gcs_server.start()  # a previous test took it down
    return gcs_server.create_bucket(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def make_gcs_server() -> Iterator:
    """Start private servers: make(backend="memory"|"filesystem") -> GcsServer.

    Each has kill(), start() and restart(downtime) on the same port; all are
    stopped at the end of the test.
    """
    servers: list[_gcs.GcsServer] = []

    def make(backend: str = "memory") -> _gcs.GcsServer:
        server = _gcs.GcsServer(backend=backend)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()
