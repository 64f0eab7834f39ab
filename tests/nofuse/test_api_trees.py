"""Index changes down dissemination trees in the daemon's peer tier, in-process:
six hosts in one trio loop over gRPC on loopback, each forwarding to at most 2
others (mtcfs.peer.dissemination.DEGREE, 8 in a daemon), so the trees have
depth 2 and hosts in the middle forward what they apply. A commit is on every
host when it returns; a host in the middle that dies has its range re-split
and the commit still reaches every live host."""

from __future__ import annotations

import socket
import time

import pytest
import trio

from mtcfs.peer import dissemination

from support.inprocess import Host

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

HOSTS = 6


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def cluster(make_host, monkeypatch) -> list[Host]:
    """Six hosts, in the trees' order (by address). The first is the writer: it
    splits the other five into two runs, so its children are the 2nd (range: 2nd
    and 3rd) and the 4th (4th to 6th)."""
    monkeypatch.setattr(dissemination, "DEGREE", 2)
    addrs = sorted(f"127.0.0.1:{p}" for p in free_ports(HOSTS))
    hosts = []
    for i, addr in enumerate(addrs):
        hosts.append(await make_host(
            f"h{i}", start=False, listen=addr, insecure=True, replicas=0,
            commit_timeout=15, data_connections=0,
            peers=",".join(a for a in addrs if a != addr)))
    await make_host.start(*hosts)
    return hosts


def tree(h: Host) -> dict:
    assert h.mount.peers is not None
    return h.mount.peers.broadcaster.tree_status()


async def test_a_commit_is_on_every_host_of_a_deep_tree_when_it_returns(
        make_host, monkeypatch) -> None:
    hosts = await cluster(make_host, monkeypatch)
    writer = hosts[0]
    before = [tree(h)["forwards_sent"] for h in hosts]
    writer.makedirs("step_1")
    for i in range(20):
        await writer.write_file(f"step_1/shard-{i}", b"x" * (i + 1))
    await writer.write_file("step_1/commit_success.txt", b"ok", fsync=True)
    # The moment the fsync returned, every host has every file of the step.
    for h in hosts[1:]:
        assert sorted(h.listdir("step_1")) == sorted(
            [f"shard-{i}" for i in range(20)] + ["commit_success.txt"]), h.mount.opts.node_id
        assert h.state("step_1/shard-7")["size"] == 8
    sent = [tree(h)["forwards_sent"] - b for h, b in zip(hosts, before, strict=True)]
    batches = tree(writer)["published"]
    assert batches >= 1
    # The writer sent each batch to its 2 children only; the 2nd host forwarded
    # it to the 3rd, the 4th to the 5th and 6th; the leaves forwarded nothing.
    assert sent[0] == 2 * batches, sent
    assert sent[1] == batches and sent[3] == 2 * batches, sent
    assert sent[2] == sent[4] == sent[5] == 0, sent
    assert all(tree(h)["in_flight"] == 0 for h in hosts)


async def test_a_host_in_the_middle_that_dies_has_its_range_re_split(
        make_host, monkeypatch) -> None:
    hosts = await cluster(make_host, monkeypatch)
    writer, middle = hosts[0], hosts[1]
    writer.makedirs("before")
    await writer.write_file("before/f", b"1", fsync=True)
    assert all(h.exists("before/f") for h in hosts[1:])
    # The 2nd host goes silent, as a killed daemon does: no datagrams, no gRPC.
    mp = middle.mount.peers
    assert mp is not None
    mp.members._send = lambda out: None
    mp.members.receive = lambda data, now: None
    assert mp.server is not None
    mp.server.stop(0)
    t0 = time.monotonic()
    writer.makedirs("after")
    await writer.write_file("after/f", b"2", fsync=True)
    took = time.monotonic() - t0
    late = writer.mount.peers.broadcaster.stats.timeouts
    # It returned once SWIM declared the silent host dead (not at the commit
    # timeout), and the hosts of its range got the batch from the writer.
    assert late == 0 and took < 12, (late, took)
    for h in hosts[2:]:
        assert h.exists("after/f"), h.mount.opts.node_id
    wt = tree(writer)
    assert wt["regrafts"] >= 1 and wt["in_flight"] == 0, wt
    await trio.sleep(0)
