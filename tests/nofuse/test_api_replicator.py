"""The Replicator's choices, in-process (mtcfs.peer.replicator): which peer gets a
replica, how many (K), a dead holder's copy made again elsewhere, pushes that
yield to the trainer's writes, and the files that need no copies (foreign,
rewritten, retired and persisted, removed)."""

from __future__ import annotations

import os
import time

import google_crc32c
import pytest
import trio

from mtcfs.peer import mover
from mtcfs.peer.replicator import ReplicationQueue

from support.inprocess import until
from support.peercluster import cluster, ram_bytes

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def holders(h, path: str) -> list[str]:
    return sorted(h.node(path).holders)


async def test_k1_puts_one_verified_replica_on_one_peer(make_host) -> None:
    a, b, c = await cluster(make_host, 3)
    data = os.urandom(300_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: len(holders(a, "f")) == 2, what="one replica")
    await until(lambda: a.mount.peers.quiet(), what="replication done")
    (other,) = [h for h in (b, c) if h.mount.opts.node_id in holders(a, "f")]
    assert ram_bytes(other, "f") == data  # the replica's bytes are the file's
    rest = ({b, c} - {other}).pop()
    assert not rest.node("f").has_data  # K=1: nobody else got one
    assert a.mount.peers.stats.replicas_sent == 1
    assert other.mount.peers.stats.replicas_received == 1


async def test_k2_puts_a_replica_on_each_of_two_peers(make_host) -> None:
    a, b, c = await cluster(make_host, 3, replicas=2)
    data = os.urandom(200_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: holders(a, "f") == ["a", "b", "c"], what="two replicas")
    for h in (b, c):
        assert google_crc32c.value(ram_bytes(h, "f")) == google_crc32c.value(data)
    assert a.mount.peers.stats.replicas_sent == 2


async def test_k0_queues_nothing(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    await a.write_file("f", b"only here", fsync=True)
    await trio.sleep(0.3)
    assert holders(a, "f") == ["a"] and not b.node("f").has_data
    assert a.mount.peers.replicator.queue.empty()
    assert a.mount.peers.stats.replicas_sent == 0


async def test_the_target_is_a_live_peer_not_a_holder_and_not_tried(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)  # (nothing pushed by itself)
    await a.write_file("f", b"x" * 1000)
    node, rep = a.node("f"), a.mount.peers.replicator
    assert rep.target(node, set()).node_id == "b"
    assert rep.target(node, {"b"}) is None  # tried already: nobody else
    node.holders = ["a", "b"]
    assert rep.target(node, set()) is None  # b holds it already


async def test_a_dead_holders_copy_is_made_again_on_another_peer(make_host) -> None:
    a, b, c = await cluster(make_host, 3)
    data = os.urandom(100_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: len(holders(a, "f")) == 2, what="the first replica")
    first = next(h for h in (b, c) if h.mount.opts.node_id in holders(a, "f"))
    other = b if first is c else c
    first.mount.stop()  # gone: its copy no longer counts
    p = a.mount.peers.members.by_node(first.mount.opts.node_id)
    p.alive = False
    a.mount.peers.peer_dead(p)  # (as membership tells it)
    await until(lambda: other.mount.opts.node_id in holders(a, "f"), what="a new replica")
    assert ram_bytes(other, "f") == data


async def test_a_file_needs_copies_only_while_written_here_sealed_and_short(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    await a.write_file("f", b"data")
    node, rep = a.node("f"), a.mount.peers.replicator
    rep.replicas = 1  # (this host's K: the test decides when it counts)
    assert rep.needs_copies(node)
    node.author = "b"  # another host's file: its writer replicates it
    assert not rep.needs_copies(node)
    node.author = "a"
    node.dirty = True  # being rewritten: the next seal is replicated
    assert not rep.needs_copies(node)
    node.dirty = False
    node.holders = ["a", "b"]  # K live copies elsewhere already
    assert not rep.needs_copies(node)


async def test_a_persisted_file_of_a_retired_step_needs_no_copies(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    a.mkdir("step_1")
    await a.write_file("step_1/f", b"data")
    node, rep = a.node("step_1/f"), a.mount.peers.replicator
    rep.replicas = 1
    rep.retired.dirs.add(a.node("step_1").ino)  # retention dropped the step everywhere
    assert rep.needs_copies(node)  # not persisted: its copies still matter
    node.persisted_version = node.version
    assert node.persisted and not rep.needs_copies(node)


async def test_requeue_takes_every_file_short_of_copies_and_skips_running_ones(
        make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    for name in ("f", "g", "h"):
        await a.write_file(name, name.encode())
    rep = a.mount.peers.replicator
    rep.replicas = 1
    rep.queue.running[a.node("h").ino] = a.node("h")  # being pushed now
    rep.requeue(wake=False)
    assert sorted(n.name for n in rep.queue.waiting.values()) == [b"f", b"g"]


async def test_a_timed_retry_takes_the_files_left_short_not_every_file(make_host) -> None:
    """A file no peer took stays in `short` and the idle workers' retry queues it
    again; files never tried (or complete) are not looked at: on a large index that
    scan was an idle host's largest cost."""
    a, b = await cluster(make_host, 2, replicas=0)
    for name in ("f", "g"):
        await a.write_file(name, name.encode())
    rep = a.mount.peers.replicator
    rep.replicas = 1
    f = a.node("f")
    rep.short[f.ino] = f  # as a worker leaves a file no peer took
    rep.retry_short(wake=False)
    assert [n.name for n in rep.queue.waiting.values()] == [b"f"]
    rep.queue.waiting.clear()
    rep.replicas = 0  # no copies needed any more: it leaves the set
    rep.retry_short(wake=False)
    assert rep.short == {} and rep.queue.waiting == {}


async def test_a_removed_file_leaves_the_queue(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    await a.write_file("f", b"data")
    rep = a.mount.peers.replicator
    rep.queue.add(a.node("f"), wake=False)
    a.unlink("f")
    assert rep.queue.waiting == {}


async def test_a_push_yields_while_the_trainer_writes(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    rep = a.mount.peers.replicator
    rep.clock.wrote()  # the trainer wrote just now
    paused = await trio.to_thread.run_sync(rep.yield_to_writes, 0.1)
    assert paused >= 0.1 - 1e-9  # the whole budget: it kept writing (to the pause)
    await trio.sleep(mover.QUIET + 0.05)  # quiet since
    assert await trio.to_thread.run_sync(rep.yield_to_writes, 1.0) == 0.0


async def test_an_fsync_waiting_makes_its_push_urgent_until_the_last_one_returns(
        make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    await a.write_file("f", b"data")
    node, rep = a.node("f"), a.mount.peers.replicator
    a.mount.peers.fsync_waiting(node, True)
    a.mount.peers.fsync_waiting(node, True)
    a.mount.peers.fsync_waiting(node, False)
    assert rep.urgent(node)  # one fsync still waits
    a.mount.peers.fsync_waiting(node, False)
    assert not rep.urgent(node)


async def test_the_queue_wakes_a_worker_and_times_out_without_one() -> None:
    q = ReplicationQueue()
    t0 = time.monotonic()
    assert not await q.wait(0.05)
    assert time.monotonic() - t0 >= 0.05
    q.wake()
    assert await q.wait(5)
