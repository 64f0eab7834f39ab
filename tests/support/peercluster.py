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


async def sorted_cluster(make_host: Any, n: int, **cli: Any) -> list[Host]:
    """n hosts "h0", "h1", ... in the sorted order of their addresses (the order of the
    dissemination trees and groups), no replicas, no data channel."""
    addrs = sorted(f"127.0.0.1:{free_port()}" for _ in range(n))
    hosts = []
    for i, addr in enumerate(addrs):
        hosts.append(await make_host(
            f"h{i}", start=False, listen=addr, insecure=True, replicas=0,
            commit_timeout=15, data_connections=0,
            peers=",".join(a for a in addrs if a != addr), **cli))
    await make_host.start(*hosts)
    return hosts


def tree(h: Host) -> dict:
    """The host's dissemination status (`peers.tree` in `mtcfs status --json`)."""
    assert h.mount.peers is not None
    return h.mount.peers.broadcaster.tree_status()


def silence(h: Host) -> None:
    """As a killed daemon: no datagrams out or in, no gRPC server."""
    p = h.mount.peers
    assert p is not None and p.server is not None
    p.members._send = lambda out: None
    p.members.on_datagram = lambda m, now: None
    p.members.endpoint.close()  # (its datagram thread answers pings too)
    p.server.stop(0)


def ram_bytes(h: Host, path: str) -> bytes:
    """What `h` holds of `path` in its RAM tier (its own file, not a read through it)."""
    node = h.node(path)
    with open(h.mount.ram.path(node.ino), "rb") as f:
        return f.read()
