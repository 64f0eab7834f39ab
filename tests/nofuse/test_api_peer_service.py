"""PeerService's answers and refusals, in-process (mtcfs.peer.service): what the
gRPC service and the data channel's server hand it, called as they call it (in
the trio thread). Unknown ids, stale versions and incomplete copies are refused
with the status that says so; what it serves is the file's verified bytes; the
index's outbox carries each local change to the broadcaster."""

from __future__ import annotations

import os

import google_crc32c
import grpc
import pytest

from mtcfs.core.namespace import ROOT_GUID
from mtcfs.peer.dissemination import MAX_BATCH
from mtcfs.peer.outbox import Outbox
from mtcfs.peer.server import Refused
from mtcfs.peer.snapshots import Snapshots
from mtcfs.peer.v1 import peer_pb2 as pb

from support.inprocess import Host, until
from support.peercluster import cluster

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

UNKNOWN = "f" * 32


def refused(code: grpc.StatusCode, fn, *args) -> str:
    with pytest.raises(Refused) as e:
        fn(*args)
    assert e.value.code == code, (e.value.code, str(e.value))
    return str(e.value)


def receive(service, e: pb.Entry, data: bytes, above: list[pb.Entry] = ()) -> bool:
    """A replica of `e` with these bytes (and the directories it carries), received as
    the data channel receives one."""
    key, tmp = service.begin_receive(e)
    with open(tmp, "r+b") as f:
        f.write(data)
    return service.finish_receive(e, list(above), key, tmp)


async def one_host(make_host) -> Host:
    (a, _b) = await cluster(make_host, 2, replicas=0)
    return a


async def test_fetch_of_an_unknown_id_is_not_found(make_host) -> None:
    a = await one_host(make_host)
    refused(grpc.StatusCode.NOT_FOUND, a.mount.peers.service.open_for_fetch, UNKNOWN, 1)


async def test_fetch_of_another_version_is_refused(make_host) -> None:
    a = await one_host(make_host)
    node = await a.write_file("f", b"version one")
    msg = refused(grpc.StatusCode.FAILED_PRECONDITION, a.mount.peers.service.open_for_fetch,
                  node.guid, node.version + 1)
    assert f"version {node.version} here" in msg


async def test_fetch_of_a_file_being_written_is_refused_until_sealed(make_host) -> None:
    a = await one_host(make_host)
    fh = await a.open("f", os.O_WRONLY | os.O_CREAT)
    await a.write(fh, 0, b"not yet")
    guid = a.node("f").guid
    refused(grpc.StatusCode.FAILED_PRECONDITION, a.mount.peers.service.open_for_fetch, guid, 0)
    await a.close(fh)
    fd, size = a.mount.peers.service.open_for_fetch(guid, 0)
    try:
        assert size == 7 and os.pread(fd, 100, 0) == b"not yet"
    finally:
        os.close(fd)


async def test_fetch_of_a_held_file_serves_its_sealed_bytes(make_host) -> None:
    a = await one_host(make_host)
    data = os.urandom(70_000)
    node = await a.write_file("f", data)
    fd, size = a.mount.peers.service.open_for_fetch(node.guid, node.version)
    try:
        got = os.pread(fd, size + 10, 0)
    finally:
        os.close(fd)
    assert size == len(data) and google_crc32c.value(got) == node.crc32c


async def test_a_replica_of_a_version_held_here_already_exists(make_host) -> None:
    a = await one_host(make_host)
    node = await a.write_file("f", b"held")
    e = a.mount.peers.index.entry_of(node)
    refused(grpc.StatusCode.ALREADY_EXISTS, a.mount.peers.service.begin_receive, e)


async def test_a_replica_whose_directory_has_not_arrived_is_refused_for_now(make_host) -> None:
    a = await one_host(make_host)
    e = pb.Entry(id=UNKNOWN, parent="d" * 32, name=b"f", mode=0o100644, size=4,
                 has_crc=True, crc32c=google_crc32c.value(b"data"), version=1,
                 lamport=5, writer="b", author="b", holders=["b"])
    service = a.mount.peers.service
    key, tmp = service.begin_receive(e)
    try:
        msg = refused(grpc.StatusCode.FAILED_PRECONDITION, service.finish_receive, e, [], key, tmp)
    finally:
        service.abort_receive(key, tmp)
    assert "directory" in msg and a.mount.peers.index.is_pending(UNKNOWN)


async def test_a_replica_brings_its_directories_before_its_writers_batch(make_host) -> None:
    a = await one_host(make_host)
    step = pb.Entry(id="d" * 32, parent=ROOT_GUID, name=b"step_1", mode=0o040755,
                    lamport=4, writer="b")
    shard = pb.Entry(id="e" * 32, parent=step.id, name=b"shard", mode=0o040755,
                     lamport=5, writer="b")
    data = b"data"
    e = pb.Entry(id=UNKNOWN, parent=shard.id, name=b"f", mode=0o100644, size=len(data),
                 has_crc=True, crc32c=google_crc32c.value(data), version=1,
                 block_size=4 << 20, block_crcs=google_crc32c.value(data).to_bytes(4, "little"),
                 lamport=6, writer="b", author="b", holders=["b"])
    assert receive(a.mount.peers.service, e, data, above=[step, shard])
    node = a.node("step_1/shard/f")
    assert node.has_data and node.guid == UNKNOWN
    assert not a.mount.peers.index.is_pending(UNKNOWN)
    assert await a.read_file("step_1/shard/f") == data


async def test_a_replica_of_a_version_that_changed_here_is_refused(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    node = await b.write_file("f", b"data", fsync=True)
    e = b.mount.peers.index.entry_of(node)
    e.crc32c ^= 1  # not the version a knows (same stamp: a keeps its own)
    service = a.mount.peers.service
    key, tmp = service.begin_receive(e)
    try:
        msg = refused(grpc.StatusCode.FAILED_PRECONDITION, service.finish_receive, e, [], key, tmp)
    finally:
        service.abort_receive(key, tmp)
    assert "changed" in msg and not a.node("f").has_data


async def test_a_replica_received_is_installed_and_counted(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    data = b"replica bytes"
    node = await b.write_file("f", data, fsync=True)
    e = b.mount.peers.index.entry_of(node)
    assert receive(a.mount.peers.service, e, data)
    assert a.node("f").has_data and a.mount.peers.stats.replicas_received == 1
    with open(a.mount.ram.path(a.node("f").ino), "rb") as f:
        assert f.read() == data


async def test_a_chunk_of_an_unknown_file_is_not_found(make_host) -> None:
    a = await one_host(make_host)
    with pytest.raises(Refused) as e:
        await a.mount.peers.service.serve_chunk(UNKNOWN, 1, 0, 10, False, 1.0)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


async def test_a_chunk_beyond_the_end_is_out_of_range(make_host) -> None:
    a = await one_host(make_host)
    node = await a.write_file("f", b"short")
    with pytest.raises(Refused) as e:
        await a.mount.peers.service.serve_chunk(node.guid, node.version, 0, 100, False, 1.0)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE


async def test_held_lists_sealed_files_with_data_only(make_host) -> None:
    a, b = await cluster(make_host, 2, replicas=0)
    await a.write_file("mine", b"here", fsync=True)
    await b.write_file("theirs", b"there", fsync=True)
    fh = await a.open("open", os.O_WRONLY | os.O_CREAT)
    await a.write(fh, 0, b"writing")
    try:
        await until(lambda: a.exists("theirs"), what="b's file known to a")
        held = a.mount.peers.service.held()
        assert [(h.path, h.size, h.crc32c) for h in held] == [
            ("mine", 4, google_crc32c.value(b"here"))]
    finally:
        await a.close(fh)


async def test_a_snapshot_served_is_the_whole_index_and_counted(make_host) -> None:
    a = await one_host(make_host)
    a.mkdir("d")
    for i in range(5):
        await a.write_file(f"d/f{i}", b"x")
    service, st = a.mount.peers.service, a.mount.peers.stats
    served, entries = st.snapshots_served, st.snapshot_entries_served  # (b's join pulled one)
    pieces = list(service.snapshot_for("z", "", 2))
    assert [len(p) for p in pieces] == [2, 2, 2]  # d and its 5 files, 2 per piece
    names = sorted(e.name for p in pieces for e in p)
    assert names == [b"d", *(f"f{i}".encode() for i in range(5))]
    assert st.snapshots_served == served + 1 and st.snapshot_entries_served == entries + 6
    assert [e.id for e in Snapshots(a.mount.peers.index).whole()] == [
        e.id for p in pieces for e in p]


async def test_a_delta_snapshot_holds_only_what_changed_lately(make_host) -> None:
    a = await one_host(make_host)
    index = a.mount.peers.index
    await a.write_file("old", b"1")
    index.recent.times[a.node("old").guid] -= 120  # changed two minutes ago
    await a.write_file("new", b"2")
    deltas = a.mount.peers.stats.delta_snapshots_served
    pieces = list(a.mount.peers.service.snapshot_for("z", "", 100, since=60))
    assert [e.name for p in pieces for e in p] == [b"new"]
    assert a.mount.peers.stats.delta_snapshots_served == deltas + 1


async def test_a_batch_is_applied_and_counted(make_host) -> None:
    a = await one_host(make_host)
    batch = pb.ChangeBatch(from_node="b", lamport=50, entries=[
        pb.Entry(id="d" * 32, parent=ROOT_GUID, name=b"from_b", mode=0o40755, lamport=50,
                 writer="b")])
    assert a.mount.peers.service.on_batch(batch) == 1
    assert a.exists("from_b") and a.mount.peers.stats.batches_received == 1
    assert a.mount.peers.service.lamport() >= 50


async def test_health_says_who_and_where(make_host) -> None:
    a = await one_host(make_host)
    reply = a.mount.peers.service.health_reply()
    assert reply.node_id == "a" and reply.data_port == a.mount.peers.data_port > 0
    assert reply.ram_capacity == a.mount.ram.capacity


async def test_each_local_change_goes_through_the_outbox_to_the_broadcaster(make_host) -> None:
    a = await one_host(make_host)
    peers = a.mount.peers
    assert peers.index.outbox is peers.broadcaster.outbox  # one outbox, built first
    n = peers.broadcaster.stats.entries_sent
    await a.write_file("f", b"x", fsync=True)  # fsync: published and applied everywhere
    assert peers.broadcaster.stats.entries_sent > n and peers.index.outbox.count() == 0


async def test_an_outbox_hands_out_entries_in_order_and_in_batches() -> None:
    box = Outbox()
    box.put([pb.Entry(id=f"{i:032x}") for i in range(MAX_BATCH + 3)])
    box.put([])
    first = box.take(MAX_BATCH)
    assert len(first) == MAX_BATCH and first[0].id == f"{0:032x}"
    assert [e.id for e in box.take(MAX_BATCH)] == [f"{i:032x}" for i in range(MAX_BATCH,
                                                                          MAX_BATCH + 3)]
    assert box.count() == 0


async def test_a_marker_that_arrives_as_a_replica_commits_this_hosts_files(
        make_host, tmp_path) -> None:
    """A commit marker whose replica reaches this host before its index entry (its
    writer was cut off while it committed, then pushed the replica at once) commits
    the step here too: this host's own files in it are queued for upload. A 25-minute
    chaos run saw them never uploaded, and the writer's marker held for good."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    a, _b = await cluster(make_host, 2, replicas=0, bucket=f"file://{bucket}", persist="step")
    a.mkdir("step_6")  # a step committed here: the uploader is running
    await a.write_file("step_6/.metadata", b"6")
    await until(lambda: a.node("step_6/.metadata").persisted, what="step 6 persisted")
    a.mkdir("step_7")
    await a.write_file("step_7/__0_0.distcp", b"a's shard")
    uploader = a.mount.uploader
    assert not uploader.queue and not a.node("step_7/__0_0.distcp").persisted
    data = b"the step's metadata"
    e = pb.Entry(id=UNKNOWN, parent=a.node("step_7").guid, name=b".metadata", mode=0o100644,
                 size=len(data), has_crc=True, crc32c=google_crc32c.value(data), version=1,
                 lamport=a.mount.peers.index.clock + 5, writer="b", author="b",
                 holders=["b"])
    assert receive(a.mount.peers.service, e, data)
    await until(lambda: a.node("step_7/__0_0.distcp").persisted, what="a's shard persisted")
    assert (bucket / "step_7" / "__0_0.distcp").read_bytes() == b"a's shard"
