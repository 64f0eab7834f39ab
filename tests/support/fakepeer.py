"""A real daemon whose one configured peer is a UDP socket of the test: the test
speaks SWIM's datagrams to it, sealed with the job's key (or not)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from support.gcs_server import free_port
from support.mounts import MtcfsMount, dispose


@dataclass
class DaemonAndSocket:
    mount: MtcfsMount
    addr: str  # the daemon's --listen
    fake: str  # the test socket's address (the daemon's only --peers entry)
    sock: socket.socket
    token: bytes

    def send(self, data: bytes) -> None:
        """A datagram from the test's socket to the daemon."""
        host, port = self.addr.rsplit(":", 1)
        self.sock.sendto(data, (host, int(port)))


@contextmanager
def daemon_with_fake_peer(tmp: Path, extra: tuple[str, ...] = ()) -> Iterator[DaemonAndSocket]:
    """Started with the socket silent (a peer that answered would be joined from);
    unmounted, its RAM tier removed and the socket closed on the way out."""
    ram_root = Path("/dev/shm") / f"mtcfs-test-{uuid.uuid4().hex[:10]}"
    ram_root.mkdir()
    token = os.urandom(16).hex().encode()
    (tmp / "token").write_bytes(token + b"\n")
    mp = tmp / "mnt"
    mp.mkdir()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    fake = f"127.0.0.1:{sock.getsockname()[1]}"
    addr = f"127.0.0.1:{free_port()}"
    m = MtcfsMount(mp, ram_root / "ram-a", "64MiB", "node-a",
                   ("--listen", addr, "--peers", fake, "--token-file", str(tmp / "token"),
                    *extra))
    try:
        m.start(timeout=30)
        yield DaemonAndSocket(m, addr, fake, sock, token)
    finally:
        sock.close()
        dispose(m, ram_root)
