"""The PeerReader's fallbacks, in-process (mtcfs.peer.reader): a holder that cannot
serve gives way to the next holder, then to the bucket; a copy whose blocks do not
match the index's crc32cs is refused; a file of several blocks comes striped from
every holder over the data channel, or from one holder at a time over gRPC."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtcfs.core.checksums import BLOCK
from mtcfs.fs.errors import FsError
from mtcfs.peer.datachannel import NoDataChannel
from mtcfs.peer.striped import STRIPE_BLOCKS

from support.inprocess import Host, until
from support.peercluster import cluster

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def node_id(h: Host) -> str:
    return h.mount.opts.node_id


async def replicated(a: Host, path: str, data: bytes, others: list[Host]) -> Host:
    """`a` writes `path`; returns the peer that got its one replica."""
    await a.write_file(path, data, fsync=True)
    await until(lambda: len(a.node(path).holders) == 2, what="a replica")
    holder = next(h for h in others if node_id(h) in a.node(path).holders)
    await until(lambda: node_id(holder) in [p for r in others
                                            for p in r.node(path).holders if r is not holder],
                what="the replica announced")
    return holder


async def sources(h: Host, path: str = "f") -> dict[str, int]:
    """Where `h`'s copy of `path` came from, once its fetch completed."""
    await until(lambda: h.node(path).has_data and bool(h.mount.fetcher.sources),
                what="the fetch done")
    return h.mount.fetcher.sources


def lose_copy(h: Host, path: str) -> None:
    """`h`'s RAM file is gone (as if evicted a moment ago): it refuses to serve it."""
    os.unlink(h.mount.ram.path(h.node(path).ino))


def corrupt(h: Host, path: str, offset: int = 10) -> None:
    with open(h.mount.ram.path(h.node(path).ino), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


async def test_a_holder_without_its_copy_gives_way_to_the_next_holder(make_host) -> None:
    a, b, c = await cluster(make_host, 3, data_connections=0)
    data = os.urandom(400_000)
    holder = await replicated(a, "f", data, [b, c])
    reader = c if holder is b else b
    # The writer is asked first (the replica holder looks busy), and fails.
    reader.mount.peers.members.by_node(node_id(holder)).busy = 5
    lose_copy(a, "f")
    assert await reader.read_file("f") == data
    assert (await sources(reader)) == {node_id(holder): len(data)}
    assert reader.mount.peers.stats.fetch_failures == 1
    # Not persisted: the view keeps the name (a refusal may be of a moment).
    assert node_id(a) in reader.node("f").holders


async def test_an_unreachable_holder_is_not_asked(make_host) -> None:
    a, b, c = await cluster(make_host, 3, data_connections=0)
    data = os.urandom(50_000)
    holder = await replicated(a, "f", data, [b, c])
    reader = c if holder is b else b
    reader.mount.peers.members.by_node("a").unreachable = True  # alive, not answering us
    assert [p.node_id for p in reader.mount.peers.reader.holders_of(reader.node("f"))] == [
        node_id(holder)]
    assert await reader.read_file("f") == data
    assert (await sources(reader)) == {node_id(holder): len(data)}


async def test_holders_least_busy_first_never_this_host(make_host) -> None:
    a, b, c = await cluster(make_host, 3, replicas=0)
    await a.write_file("f", b"x", fsync=True)
    node = c.node("f")
    node.holders = ["a", "b", "c"]
    members = c.mount.peers.members
    members.by_node("a").busy, members.by_node("b").busy = 3, 1
    assert [p.node_id for p in c.mount.peers.reader.holders_of(node)] == ["b", "a"]


async def test_with_every_holder_failing_the_bucket_serves_it(make_host,
                                                              tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    a, b = await cluster(make_host, 2, replicas=0, bucket=f"file://{bucket}",
                         persist="on-close")
    data = os.urandom(300_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: a.node("f").persisted and b.node("f").persisted, what="persisted")
    lose_copy(a, "f")
    assert await b.read_file("f") == data
    assert list(await sources(b)) == [f"file://{bucket}"]
    assert b.mount.peers.stats.fetch_failures >= 1


async def test_a_corrupt_copy_is_refused_and_the_bucket_serves_it(make_host,
                                                                  tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    a, b = await cluster(make_host, 2, replicas=0, bucket=f"file://{bucket}",
                         persist="on-close")
    data = os.urandom(200_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: a.node("f").persisted and b.node("f").persisted, what="persisted")
    corrupt(a, "f")
    assert await b.read_file("f") == data  # never the corrupt bytes
    assert b.mount.peers.stats.integrity_errors >= 1
    assert list(await sources(b)) == [f"file://{bucket}"]


async def test_a_corrupt_copy_without_a_bucket_fails_the_read(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    data = os.urandom(100_000)
    await a.write_file("f", data, fsync=True)
    corrupt(a, "f", offset=len(data) - 5)
    with pytest.raises((FsError, OSError)):
        await b.read_file("f")
    assert b.mount.peers.stats.integrity_errors >= 1
    assert not b.node("f").has_data


async def test_a_file_of_several_blocks_comes_striped_from_every_holder(make_host) -> None:
    # One connection per holder, two stripes (STRIPE_BLOCKS blocks each): each holder
    # takes one at once.
    a, b, c = await cluster(make_host, 3, data_connections=1)
    data = os.urandom(STRIPE_BLOCKS * BLOCK + 1000)
    holder = await replicated(a, "f", data, [b, c])
    reader = c if holder is b else b
    assert await reader.read_file("f", chunk=1 << 20) == data
    got = (await sources(reader))
    assert set(got) == {"a", node_id(holder)} and sum(got.values()) == len(data)
    assert reader.mount.peers.stats.bulk_fetched_bytes == len(data)


async def test_a_striped_holder_that_fails_leaves_its_blocks_to_the_others(make_host) -> None:
    a, b, c = await cluster(make_host, 3, data_connections=1)
    data = os.urandom(STRIPE_BLOCKS * BLOCK + 10)  # two stripes: the writer is asked for one
    holder = await replicated(a, "f", data, [b, c])
    reader = c if holder is b else b
    lose_copy(a, "f")
    assert await reader.read_file("f", chunk=1 << 20) == data
    assert (await sources(reader)) == {node_id(holder): len(data)}
    assert reader.mount.peers.stats.fetch_failures >= 1


async def test_without_a_data_channel_bytes_come_over_grpc(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0, data_connections=0)
    assert isinstance(b.mount.peers.channel, NoDataChannel)
    data = os.urandom(150_000)
    await a.write_file("f", data, fsync=True)
    assert await b.read_file("f") == data
    assert (await sources(b)) == {"a": len(data)}
    assert b.mount.peers.stats.bulk_fetched_bytes == 0
    # A restore from the bucket together with peers needs the data channel: the
    # caller reads alone.
    assert await b.mount.peers.reader.restore(b.node("f"), -1, None, "f", 1, 1,  # type: ignore[arg-type]
                                              lambda off, n: None) is None


async def test_restore_sources_are_this_host_and_peers_with_a_data_channel(make_host) -> None:
    a, b, c = await cluster(make_host, 3, replicas=0)
    await a.write_file("f", b"x", fsync=True)
    node = c.node("f")
    node.sources = ["a", "b", "gone"]
    c.mount.peers.members.by_node("b").data_port = 0  # no data channel there
    assert c.mount.peers.reader.restore_sources(node) == ["a", "c"]


@pytest.mark.parametrize("connections", [2, 0], ids=["data-channel", "grpc"])
async def test_a_holder_that_says_it_has_no_copy_is_not_asked_again_over_grpc(
        make_host, tmp_path: Path, connections: int) -> None:
    """b still lists a as a holder of a file a no longer has (a view can be stale): a's
    answer on the data channel, that it has no copy, is not asked for a second time
    over gRPC, and b's view of the persisted file stops naming a; the bucket serves
    the read."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    a, b = await cluster(make_host, 2, replicas=0, bucket=f"file://{bucket}",
                         persist="on-close", data_connections=connections)
    data = os.urandom(300_000)
    await a.write_file("f", data, fsync=True)
    await until(lambda: a.node("f").persisted and b.node("f").persisted, what="persisted")
    assert node_id(a) in b.node("f").holders
    a.node("f").has_data = False  # (its drop not announced: b's view is stale)
    assert await b.read_file("f") == data
    assert list(await sources(b)) == [f"file://{bucket}"]
    assert b.mount.peers.stats.fetch_failures == 1  # (on the data channel: alone)
    # a's own word: b's view of this persisted file no longer names it.
    assert node_id(a) not in b.node("f").holders
