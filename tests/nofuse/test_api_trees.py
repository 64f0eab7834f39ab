"""Index changes down dissemination trees in the daemon's peer tier, in-process:
six hosts in one trio loop over gRPC on loopback, each forwarding to at most 2
others (mtcfs.peer.dissemination.DEGREE, 8 in a daemon), so the trees have
depth 2 and hosts in the middle forward what they apply. A commit is on every
host when it returns; hosts inside the trees that die have their ranges
re-split and the commit still reaches every live host."""

from __future__ import annotations

import time

import pytest

from mtcfs.peer import dissemination

from support.inprocess import Host
from support.peercluster import silence, sorted_cluster, tree

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

HOSTS = 6


async def cluster(make_host, monkeypatch) -> list[Host]:
    """Six hosts, in the trees' order (by address). The first is the writer: it
    splits the other five into two runs, so its children are the 2nd (range: 2nd
    and 3rd) and the 4th (4th to 6th)."""
    monkeypatch.setattr(dissemination, "DEGREE", 2)
    return await sorted_cluster(make_host, HOSTS)


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


async def test_hosts_that_die_inside_the_trees_have_their_ranges_re_split(
        make_host, monkeypatch) -> None:
    hosts = await cluster(make_host, monkeypatch)
    writer = hosts[0]
    writer.makedirs("before")
    await writer.write_file("before/f", b"1", fsync=True)
    assert all(h.exists("before/f") for h in hosts[1:])
    # The 2nd host (the writer's child, range 2nd-3rd) and the 5th (the 4th's child)
    # go silent, as killed daemons do.
    silence(hosts[1])
    silence(hosts[4])
    t0 = time.monotonic()
    writer.makedirs("after")
    await writer.write_file("after/f", b"2", fsync=True)
    took = time.monotonic() - t0
    # It returned once SWIM declared them dead (not at the commit timeout), and the
    # live hosts of their ranges got the batch: the 3rd from the writer, the 6th
    # from the 4th.
    assert writer.mount.peers.broadcaster.stats.timeouts == 0 and took < 12, took
    for h in (hosts[2], hosts[3], hosts[5]):
        assert h.exists("after/f"), h.mount.opts.node_id
    wt, mid = tree(writer), tree(hosts[3])
    assert wt["regrafts"] >= 1 and mid["regrafts"] >= 1, (wt, mid)
    # The 4th could not answer the writer's forward with its range's ack in time (a
    # host of it was not answering): the ack went up as a call of its own.
    assert mid["acks_sent"] > mid["acks_in_replies"], mid
    assert all(tree(h)["in_flight"] == 0 for h in (writer, hosts[2], hosts[3], hosts[5]))
