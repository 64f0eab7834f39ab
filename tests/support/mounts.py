"""Real mtcfs daemons as subprocesses with real FUSE mounts, and the helpers tests
and benchmarks share (imported as `support.mounts`; the fixtures live in
tests/conftest.py).

The daemon is never run in the calling process: a blocking call on a mount from
the thread that serves it would deadlock.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import google_crc32c

from mtcfs import control
from mtcfs.config import mount_entry

from support import ports

MTCFS = [sys.executable, "-m", "mtcfs"]

# The data paths a module parametrizes over when it covers both.
BOTH_DATA_PATHS = ["passthrough", "fuse"]

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


def dispose(m: MtcfsMount, ram_root: Path | None = None) -> None:
    """Stop a test's daemon (killed if it will not stop) and detach its mount and its
    RAM tier's tmpfs; with `ram_root` (a test's own RAM root), detach everything below
    it and remove it too."""
    try:
        m.stop()
    finally:
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait()
        force_unmount(str(m.path))
        unmount_under(ram_root or m.ram_dir)
        if ram_root is not None:
            shutil.rmtree(ram_root, ignore_errors=True)


def blob(seed: int, size: int) -> bytes:
    """Reproducible test data."""
    return random.Random(seed).randbytes(size)


def crc_of(data: bytes) -> int:
    return google_crc32c.value(data)


def with_any_data_port(extra: tuple[str, ...]) -> tuple[str, ...]:
    """Daemons that --listen on loopback get their data channel on any free port: the
    default (the --listen port + 1) may be a port another test's daemon or client holds
    when tests run in parallel (a CI run failed on EADDRINUSE there)."""
    if "--listen" not in extra or "--data-listen" in extra:
        return extra
    host = extra[extra.index("--listen") + 1].rsplit(":", 1)[0]
    return (*extra, "--data-listen", f"{host}:0")


class MtcfsMount:
    """One mtcfs daemon (foreground subprocess) and its mount."""

    def __init__(self, mountpoint: Path, ram_dir: Path, ram_size: str = "2GiB",
                 node_id: str = "node-a", extra: tuple[str, ...] = ()) -> None:
        self.path = mountpoint
        self.ram_dir = ram_dir
        self.ram_size = ram_size
        self.node_id = node_id
        self.extra = with_any_data_port(extra)
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
            if mount_entry(str(self.path)) is not None and self._started():
                try:
                    os.getxattr(self.path, "user.mtcfs.control")
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"mount did not come up:\n{self.log()}")

    def _started(self) -> bool:
        """The daemon finished starting (data path chosen: passthrough or not): it
        writes daemon.json, with its pid, last (a mount answers a moment before)."""
        try:
            info = json.loads((self.ram_dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return False
        return self.proc is not None and info.get("pid") == self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except FileNotFoundError:
            return ""

    def status(self, settle: bool = True, cli: bool = False) -> dict:
        """The daemon's status: what `mtcfs status --json` prints, over the control socket
        (a CLI process costs ~0.6 s of CPU, and tests poll this); cli=True runs the
        command. settle: once no file is `sealing` any more (with passthrough a closed
        file is checksummed a moment after close())."""
        deadline = time.monotonic() + 10
        while True:
            if cli:
                st = json.loads(mtcfs("status", str(self.path), "--json", check=True).stdout)
            else:
                st = control.request(str(self.path), "status")["status"]
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
        """Unmount and wait for the daemon to exit. What `mtcfs umount` (no --wait) does,
        without starting a CLI process (~0.5-1 s each, at every test's teardown);
        tests/test_cli.py tests the command itself."""
        if self.proc is not None and self.proc.poll() is None:
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True)
            if r.returncode != 0:  # busy: detach lazily, the daemon exits when it is free
                force_unmount(str(self.path))
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        force_unmount(str(self.path))

    def restart(self) -> MtcfsMount:
        self.stop()
        return self.start()


def free_port() -> int:
    """A port on 127.0.0.1 for a daemon to bind later (support.ports: below the
    kernel's ephemeral range, so no port-0 bind takes it meanwhile)."""
    return ports.free_port()


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
        self._lock = threading.Lock()

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
        # Each cluster its own RAM dirs: a test's second cluster starts empty, not over
        # the metadata of the first one's (whose tmpfs close() unmounted).
        return mp, self.ram_root / f"{self.root.name}-ram-{tag}"

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
        # The data channel on any free port (port + 1 may be another host's).
        args: tuple[str, ...] = ("--listen", self.addr(name), "--data-listen", "127.0.0.1:0",
                                 "--token-file", str(self.token_file), "--replicas",
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
        with ThreadPoolExecutor(max(1, len(mounts))) as pool:
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

        with ThreadPoolExecutor(max(1, len(self.all))) as pool:
            list(pool.map(stop, self.all))


def file_crc(path: Path) -> int:
    """crc32c of a file, read in 8 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = google_crc32c.extend(crc, chunk)
    return crc


def write(m: MtcfsMount, rel: str, data: bytes) -> bytes:
    """Write `data` to `rel` on mount `m` in 8 MiB writes (parents made); returns it."""
    path = m.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for off in range(0, len(data), 8 << 20):
            f.write(data[off:off + (8 << 20)])
    return data


def pstatus(m: MtcfsMount) -> dict:
    """The peers section of the daemon's status (over the control socket: fast)."""
    return control.request(str(m.path), "status")["status"]["peers"]
