"""Shared fixtures: real mtcfs daemons as subprocesses with real FUSE mounts.

The daemon is never run in the test process: a blocking call on a mount from
the thread that serves it would deadlock. Every fixture cleans up its mounts,
processes and RAM dirs, also when the test fails.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import google_crc32c
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


def wait_until(cond: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02,
               what: str = "") -> Any:
    """Poll cond() until it returns something truthy (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what or getattr(cond, '__name__', 'a condition')}")
        time.sleep(interval)


def data_files(ram_dir: Path) -> list[Path]:
    """The RAM tier's data files (<ram-dir>/data/<ino>), not its .incoming and .trash."""
    return [p for p in (ram_dir / "data").iterdir() if not p.name.startswith(".")]


def wipe_ram_dir(ram_dir: Path) -> None:
    """Lose a host's RAM dir (its daemon stopped): with passthrough its data/ is a tmpfs
    of its own, which goes too."""
    unmount_under(ram_dir)
    shutil.rmtree(ram_dir)


def unmount_under(root: Path) -> None:
    """Detach every mount below `root` (a RAM tier's own tmpfs, a leaked FUSE mount)."""
    from mtcfs.mountinfo import mountinfo

    prefix = str(root) + os.sep
    for e in reversed(mountinfo()):
        if e.mount_point.startswith(prefix):
            subprocess.run(["umount", "-l", e.mount_point], capture_output=True)


def blob(seed: int, size: int) -> bytes:
    """Reproducible test data."""
    return random.Random(seed).randbytes(size)


def crc_of(data: bytes) -> int:
    return google_crc32c.value(data)


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

    def status(self, settle: bool = True) -> dict:
        """`mtcfs status --json`. settle: once no file is `sealing` any more (with
        passthrough a closed file is checksummed a moment after close())."""
        deadline = time.monotonic() + 10
        while True:
            st = json.loads(mtcfs("status", str(self.path), "--json", check=True).stdout)
            if not settle or not st["states"].get("sealing") or time.monotonic() > deadline:
                return st
            time.sleep(0.01)

    def state(self, rel: str, settle: bool = True) -> dict:
        """user.mtcfs.state of a file. settle: past `sealing` (with passthrough a closed
        file is checksummed when the kernel releases it, a moment after close())."""
        deadline = time.monotonic() + 10
        while True:
            st = json.loads(os.getxattr(self.path / rel, "user.mtcfs.state"))
            if not settle or st.get("state") != "sealing" or time.monotonic() > deadline:
                return st
            time.sleep(0.005)

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
    unmount_under(root)  # passthrough mounts make their RAM tier a tmpfs of its own
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def data_path() -> str:
    """--data-path of the mounts a test makes. Modules that cover both data paths
    override this with a fixture parametrized over "passthrough" and "fuse"."""
    return "auto"


@pytest.fixture
def make_mount(tmp_path: Path, ram_root: Path, data_path: str) -> Iterator:
    mounts: list[MtcfsMount] = []

    def make(name: str = "a", ram_size: str = "2GiB", extra: tuple[str, ...] = (),
             start: bool = True) -> MtcfsMount:
        mp = tmp_path / f"mnt-{name}"
        mp.mkdir(exist_ok=True)
        if "--data-path" not in extra:
            extra = (*extra, "--data-path", data_path)
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
            unmount_under(m.ram_dir)


@pytest.fixture
def mnt(make_mount) -> MtcfsMount:
    """A started mtcfs mount with a 2 GiB RAM tier."""
    return make_mount()


# -- GCS server (fake-gcs-server) for durable-tier tests -----------------------------------------
# Appended section (other engineers append fixtures too), hence the late import.

import gcs_server as _gcs  # noqa: E402

BOTH_DATA_PATHS = ["passthrough", "fuse"]


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


# -- Clusters of peered daemons on loopback (peer tier tests) ------------------------------------
# Appended section: several real daemons, each with its own FUSE mount, RAM dir and gRPC
# port on 127.0.0.1, sharing one token file. Hosts are named a, b, c, ... (node ids node-a,
# node-b, ...); a replacement host gets a new, empty RAM dir.

import socket as _socket  # noqa: E402
import threading as _threading  # noqa: E402
from concurrent.futures import ThreadPoolExecutor as _Pool  # noqa: E402


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerCluster:
    """Hosts of one job on loopback. `hosts` maps a host name to its current daemon."""

    def __init__(self, root: Path, ram_root: Path, replicas: int,
                 extra: tuple[str, ...], data_path: str = "auto") -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.ram_root = ram_root
        self.replicas = replicas
        self.extra = (*extra, "--data-path", data_path) if "--data-path" not in extra else extra
        self.token_file = root / "peer-token"
        self.token_file.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
        self.token_file.chmod(0o600)
        self.hosts: dict[str, MtcfsMount] = {}
        self.ports: dict[str, int] = {}
        self.all: list[MtcfsMount] = []  # every daemon ever made, for clean-up
        self._seq: dict[str, int] = {}
        self._lock = _threading.Lock()

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def reserve(self, *names: str) -> None:
        """Give hosts their addresses before any is defined (to list them as peers)."""
        for name in names:
            if name not in self.ports:
                self.ports[name] = free_port()

    def __getitem__(self, name: str) -> MtcfsMount:
        return self.hosts[name]

    def _new_dirs(self, name: str) -> tuple[Path, Path]:
        """A fresh mountpoint and an empty RAM dir (suffixed for replacements)."""
        with self._lock:
            n = self._seq.get(name, 0)
            self._seq[name] = n + 1
        tag = name if n == 0 else f"{name}{n}"
        mp = self.root / f"mnt-{tag}"
        mp.mkdir()
        return mp, self.ram_root / f"ram-{tag}"

    def define(self, name: str, *, node_id: str | None = None,
               peers: list[str] | None = None, extra: tuple[str, ...] = (),
               replicas: int | None = None, ram_size: str = "2GiB",
               mount: MtcfsMount | None = None) -> MtcfsMount:
        """A host's daemon, not started. `peers`: host names or addresses (default: every
        other host defined so far, and those defined later must list it). The same
        address as before when `name` was defined already (a replacement)."""
        if name not in self.ports:
            self.ports[name] = free_port()
        if peers is None:
            peers = [h for h in self.ports if h != name]
        addrs = [self.addr(p) if p in self.ports else p for p in peers]
        args: tuple[str, ...] = ("--listen", self.addr(name), "--token-file",
                                 str(self.token_file), "--replicas",
                                 str(self.replicas if replicas is None else replicas))
        if addrs:
            args += ("--peers", ",".join(addrs))
        if mount is None:
            mp, ram = self._new_dirs(name)
            mount = MtcfsMount(mp, ram, ram_size, node_id or f"node-{name}")
        mount.extra = args + self.extra + tuple(extra)
        self.hosts[name] = mount
        if mount not in self.all:
            self.all.append(mount)
        return mount

    def start(self, *names: str) -> list[MtcfsMount]:
        """Start these hosts' daemons at the same time; wait until every mount is live."""
        mounts = [self.hosts[n] for n in names]
        with _Pool(max(1, len(mounts))) as pool:
            futures = [pool.submit(m.start, 60) for m in mounts]
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return mounts

    def add(self, name: str, **kw) -> MtcfsMount:
        """Define and start one host."""
        self.define(name, **kw)
        return self.start(name)[0]

    def replace(self, name: str, node_id: str | None = None, start: bool = True,
                **kw) -> MtcfsMount:
        """A replacement for host `name` (dead or stopped): a new mountpoint and an EMPTY
        RAM dir, the same address and peers, the same node id unless another is given."""
        old = self.hosts[name]
        if old.proc is not None and old.proc.poll() is None:
            old.stop()
        force_unmount(str(old.path))
        mp, ram = self._new_dirs(name)
        m = MtcfsMount(mp, ram, old.ram_size, node_id or old.node_id)
        m.extra = old.extra
        self.hosts[name] = m
        self.all.append(m)
        if kw:
            self.define(name, mount=m, **kw)
        return m.start(60) if start else m

    def restart(self, name: str) -> MtcfsMount:
        """The same host again (same RAM dir, node id and address), after a crash or a stop."""
        m = self.hosts[name]
        if m.proc is not None and m.proc.poll() is None:
            m.stop()
        force_unmount(str(m.path))
        return m.start(60)

    def kill9(self, name: str) -> None:
        """Crash a host's daemon and detach its dead mount."""
        m = self.hosts[name]
        m.kill9()
        force_unmount(str(m.path))

    def logs(self) -> str:
        return "\n".join(f"===== {m.node_id} ({m.ram_dir.name}) =====\n{m.log()}"
                         for m in self.all)

    def close(self) -> None:
        def stop(m: MtcfsMount) -> None:
            try:
                m.stop()
            except Exception:
                pass
            finally:
                if m.proc is not None and m.proc.poll() is None:
                    m.proc.kill()
                    m.proc.wait()
                force_unmount(str(m.path))
                unmount_under(m.ram_dir)

        with _Pool(max(1, len(self.all))) as pool:
            list(pool.map(stop, self.all))


@pytest.fixture
def make_cluster(tmp_path: Path, ram_root: Path, request: pytest.FixtureRequest,
                 data_path: str) -> Iterator:
    """make_cluster(n=3, replicas=1, extra=(), start=True) -> PeerCluster with hosts a, b, c...

    Each host: `--listen 127.0.0.1:PORT --peers <all others> --token-file F --replicas K`
    plus `extra`. The daemons start concurrently (each pulls the live peers' snapshots
    at start-up). Use cluster.add/replace/restart/kill9 for more hosts, replacements
    (empty RAM dir) and crashes. Everything is stopped and unmounted at the end, and the
    daemons' logs are printed when the test failed.
    """
    clusters: list[PeerCluster] = []

    def make(n: int = 3, replicas: int = 1, extra: tuple[str, ...] = (),
             start: bool = True) -> PeerCluster:
        c = PeerCluster(tmp_path / f"cluster{len(clusters)}", ram_root, replicas, extra,
                        data_path)
        clusters.append(c)
        names = [chr(ord("a") + i) for i in range(n)]
        for name in names:
            c.ports[name] = free_port()
        for name in names:
            c.define(name)
        if start:
            c.start(*names)
        return c

    yield make
    failed = getattr(request.node, "rep_call", None)
    for c in clusters:
        if failed is not None and failed.failed:
            print(c.logs()[-30000:])
        c.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Record each phase's report on the item (make_cluster prints logs on failure)."""
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep
