"""In-process peer clusters for the peer tier's tests in tests/nofuse: n hosts on
loopback, each configured with the others, started together (as daemons are)."""

from __future__ import annotations

from typing import Any

from support.inprocess import Host
from support.ports import free_port


async def cluster(make_host: Any, n: int, **cli: Any) -> list[Host]:
    """Hosts "a", "b", ... (K=1 unless cli says otherwise), each with its data
    channel on a free port."""
    ports = [free_port() for _ in range(n)]
    names = "abcdefgh"[:n]
    common = {"insecure": True, "replicas": 1, "commit_timeout": 10,
              "data_listen": "127.0.0.1:0", **cli}
    hosts = []
    for i, name in enumerate(names):
        others = ",".join(f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != i)
        hosts.append(await make_host(name, start=False, listen=f"127.0.0.1:{ports[i]}",
                                     peers=others, **common))
    await make_host.start(*hosts)
    return hosts


def ram_bytes(h: Host, path: str) -> bytes:
    """What `h` holds of `path` in its RAM tier (its own file, not a read through it)."""
    node = h.node(path)
    with open(h.mount.ram.path(node.ino), "rb") as f:
        return f.read()
