"""A group's leader carries its members' index batches down one tree (mtcfs.peer.grouped),
in the daemon's peer tier, in-process: six hosts in one trio loop over gRPC on
loopback with --peer-group 3 and --peer-group-turn 0, so the 1st and the 4th
host (by address) lead a group of three each. A member's commit is on every host
when it returns, as with a tree of its own; a leader that dies leaves its
members' batches to go down trees of their own; with the lead turning, commits
meet whichever host leads."""

from __future__ import annotations

import time

import pytest
import trio

from mtcfs.peer import grouped

from support.inprocess import Host, until
from support.peercluster import silence, sorted_cluster, tree

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

HOSTS = 6


async def cluster(make_host) -> list[Host]:
    """Six hosts, in the sorted order of their addresses: groups of three."""
    return await sorted_cluster(make_host, HOSTS, peer_group=3, peer_group_turn=0)


async def test_a_members_commit_is_on_every_host_through_its_leader(make_host) -> None:
    hosts = await cluster(make_host)
    addrs = [h.mount.opts.listen for h in hosts]
    assert [tree(h)["leader"] for h in hosts] == [addrs[0]] * 3 + [addrs[3]] * 3
    hosts[0].makedirs("step_1")
    await hosts[0].write_file("step_1/marker", b"m", fsync=True)
    before = {h.mount.opts.node_id: tree(h) for h in hosts}
    for i, h in enumerate(hosts):
        await h.write_file(f"step_1/shard-{i}", b"x" * (i + 1), fsync=True)
        # The moment a member's fsync returned, every host has its file.
        for other in hosts:
            assert other.state(f"step_1/shard-{i}")["size"] == i + 1, (
                h.mount.opts.node_id, other.mount.opts.node_id)
    after = {h.mount.opts.node_id: tree(h) for h in hosts}

    def grew(node: str, key: str) -> int:
        return after[node][key] - before[node][key]

    # The members handed their batches to their leaders, which carried them down
    # trees of their own; nothing fell back to a tree of its writer's own.
    for member in ("h1", "h2", "h4", "h5"):
        assert grew(member, "handed") >= 1 and grew(member, "bundles") == 0, after[member]
    assert grew("h0", "carried_for_others") >= 2 and grew("h3", "carried_for_others") >= 2
    assert all(a["own_trees"] == 0 and a["in_flight"] == 0 for a in after.values()), after


async def test_a_commit_behind_a_plain_batch_at_its_leader_leaves_at_once(
        make_host, monkeypatch) -> None:
    """A leader holds a plain batch while more may join it (grouped.LINGER, here 5 s);
    a batch an fsync waits for, handed to it meanwhile, brings the bundle's time
    forward (URGENT_LINGER) and takes the plain one with it: the fsync does not
    wait out the plain batch's linger."""
    monkeypatch.setattr(grouped, "LINGER", 5.0)
    monkeypatch.setattr(grouped, "LINGER_MOST", 10.0)
    hosts = await cluster(make_host)
    leader, plain, urgent, far = hosts[0], hosts[1], hosts[2], hosts[4]
    leader.makedirs("step")
    await leader.write_file("step/marker", b"m", fsync=True)
    await plain.write_file("step/plain", b"p")  # no fsync: handed over, held
    await until(lambda: leader.exists("step/plain"), what="the hand-over")
    await trio.sleep(0.3)
    assert not far.exists("step/plain")  # held at its leader
    t0 = time.monotonic()
    await urgent.write_file("step/urgent", b"u", fsync=True)
    took = time.monotonic() - t0
    assert took < 3.0, took  # (the plain batch's linger: 5 s)
    assert far.exists("step/urgent") and far.exists("step/plain")
    assert tree(leader)["bundles"] >= 1 and tree(urgent)["own_trees"] == 0


async def test_a_dead_leaders_members_send_their_batches_down_their_own_trees(
        make_host) -> None:
    hosts = await cluster(make_host)
    member, leader = hosts[4], hosts[3]
    member.makedirs("before")
    await member.write_file("before/f", b"1", fsync=True)
    assert all(h.exists("before/f") for h in hosts)
    silence(leader)
    t0 = time.monotonic()
    member.makedirs("after")
    await member.write_file("after/f", b"2", fsync=True)
    took = time.monotonic() - t0
    # It returned once the leader was found gone (its hand-over failed at once, its
    # tree waited for SWIM to declare it dead), not at the commit timeout.
    assert member.mount.peers.broadcaster.stats.timeouts == 0 and took < 12, took
    for h in hosts:
        if h is not leader:
            assert await h.read_file("after/f") == b"2", h.mount.opts.node_id
    assert tree(member)["own_trees"] >= 1, tree(member)
    # Once it is dead everywhere, the member leads its group itself: its next batch
    # gathers nothing for long and goes down its tree.
    await member.write_file("after/g", b"3", fsync=True)
    assert all(h.exists("after/g") for h in hosts if h is not leader)
    assert tree(member)["leader"] == member.mount.opts.listen


async def test_with_the_lead_turning_commits_reach_every_host_and_several_hosts_lead(
        make_host) -> None:
    """--peer-group-turn 0.2: the lead of each group of three changes while its hosts
    commit, one after the other, for about 3 s. Each fsync returns with its file on
    every host; the hand-overs meet whichever host leads at the time, and several
    hosts of each group carry others' batches."""
    hosts = await sorted_cluster(make_host, HOSTS, peer_group=3, peer_group_turn=0.2)
    hosts[0].makedirs("step_1")
    leaders: set[str] = set()
    before = {h.mount.opts.node_id: tree(h)["carried_for_others"] for h in hosts}
    start = time.monotonic()
    k = 0
    while time.monotonic() - start < 3.0 or k < 12:
        h = hosts[k % HOSTS]
        leaders |= {tree(x)["leader"] for x in hosts}
        await h.write_file(f"step_1/shard-{k}", b"x" * (k + 1), fsync=True)
        for other in hosts:
            assert other.state(f"step_1/shard-{k}")["size"] == k + 1, (k, other.mount.opts.node_id)
        k += 1
        await trio.sleep(0.03)
    carried = {n for n, c in ((h.mount.opts.node_id, tree(h)["carried_for_others"])
                              for h in hosts) if c > before[n]}
    assert len(leaders) >= 4, leaders  # (6 hosts: at most 6; fixed, it would be 2)
    assert len(carried) >= 3, carried
    assert all(tree(h)["in_flight"] == 0 for h in hosts)
