"""mtcfs daemons in network-namespace hosts (support.netns): one foreground `mtcfs
mount` per host, listening on the host's own address (port PORT), and a reader
that reads a file in a subprocess (a hung FUSE read must not hang its caller).
Used by tests/test_peers_netns.py and bench/netns_restore.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mtcfs import control
from mtcfs.config import mount_entry

from support.mounts import force_unmount
from support.netns import Host

MiB = 1 << 20
PORT = 7000

# Reads a file in a subprocess; prints {"ok", "size", "crc", "errno", "elapsed"} as JSON.
READER = r"""
import json, sys, time
import google_crc32c
t0 = time.monotonic()
crc = n = 0
try:
    with open(sys.argv[1], "rb", buffering=0) as f:
        while b := f.read(8 << 20):
            crc = google_crc32c.extend(crc, b)
            n += len(b)
    out = {"ok": True, "size": n, "crc": crc}
except OSError as e:
    out = {"ok": False, "errno": e.errno, "error": str(e), "size": n}
out["elapsed"] = round(time.monotonic() - t0, 3)
print(json.dumps(out), flush=True)
"""


class Node:
    """One mtcfs daemon in a host of the cluster (foreground, started with host.popen)."""

    def __init__(self, host: Host, node_id: str, mp: Path, ram_dir: Path, log_path: Path,
                 args: list[str], ram_size: str = "3GiB") -> None:
        self.host = host
        self.node_id = node_id
        self.mp = mp
        self.ram_dir = ram_dir
        self.log_path = log_path
        self.args = args
        self.ram_size = ram_size
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"Node({self.node_id}@{self.host.addr})"

    @property
    def addr(self) -> str:
        return f"{self.host.addr}:{PORT}"

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = self.host.popen(
                [sys.executable, "-m", "mtcfs", "mount", str(self.mp), "--ram-dir",
                 str(self.ram_dir), "--ram-size", self.ram_size, "--node-id", self.node_id,
                 "--log-level", "info", *self.args],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def wait_live(self, timeout: float = 60.0) -> Node:
        """Like MtcfsMount.start: the mount entry, then the control xattr answers."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self} exited with {self.proc.returncode}:\n{self.log()}")
            if mount_entry(str(self.mp)) is not None:
                try:
                    os.getxattr(self.mp, "user.mtcfs.control")
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"{self}: mount did not come up:\n{self.log()}")

    def log(self, tail: int = 12000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """Crash the daemon (nsenter exec'd it: the Popen is the daemon) and detach
        its dead mount."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        force_unmount(str(self.mp))

    def stop(self) -> None:
        """Unmount (lazily: works whatever the network does) and let the daemon exit."""
        if mount_entry(str(self.mp)) is not None:
            subprocess.run(["fusermount3", "-uz", str(self.mp)], capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        force_unmount(str(self.mp))

    # -- views ---------------------------------------------------------------------------

    def path(self, rel: str) -> Path:
        return self.mp / rel

    def state(self, rel: str) -> dict | None:
        try:
            return json.loads(os.getxattr(self.mp / rel, "user.mtcfs.state"))
        except OSError:
            return None

    def status(self) -> dict:
        return control.request(str(self.mp), "status", timeout=10)["status"]

    def pstatus(self) -> dict:
        return self.status()["peers"]

    def live_peers(self) -> set[str]:
        return {p["node_id"] for p in self.pstatus()["peers"] if p["alive"]}

    def write(self, rel: str, data: bytes) -> bytes:
        p = self.mp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            for off in range(0, len(data), 8 * MiB):
                f.write(data[off:off + 8 * MiB])
        return data

    def start_read(self, rel: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", READER, str(self.mp / rel)],
                                stdout=subprocess.PIPE, text=True)

    def read(self, rel: str, hang_after: float = 60.0) -> dict:
        """Read the whole file in a subprocess; a read still running after `hang_after`
        seconds is a hang (the subprocess is killed and the test fails)."""
        proc = self.start_read(rel)
        return finish_read(proc, hang_after, f"read of {rel} on {self.node_id}")


def finish_read(proc: subprocess.Popen, hang_after: float, what: str) -> dict:
    try:
        out, _ = proc.communicate(timeout=hang_after)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{what} hung (still blocked after {hang_after:g} s)") from None
    return json.loads(out)
