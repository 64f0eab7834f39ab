"""The uploader's parts (mtcfs/persist/): deletes (markers first), the marker gate
(markers last), retries with one backoff, server-side copies; and Copies, the one
announcer of every copy change, persisted included."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, Inode
from mtcfs.persist.attempts import MAX_BACKOFF, Backoff, Stats
from mtcfs.persist.deletes import Deletes
from mtcfs.persist.markers import Links, Markers
from mtcfs.tiers.durable import Unavailable, open_durable

from support.inprocess import Host, until

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


class Heard(Listener):
    def __init__(self) -> None:
        self.persisted_nodes: list[str] = []

    def persisted(self, node: Inode) -> None:
        self.persisted_nodes.append(node.guid)


async def bucket_host(make_host, tmp_path: Path, **cli: Any) -> tuple[Host, Path]:
    bucket = tmp_path / "bucket"
    bucket.mkdir(exist_ok=True)
    return await make_host(bucket=f"file://{bucket}", **cli), bucket


async def test_copies_announce_persisted_once_per_upload(make_host, tmp_path: Path) -> None:
    h, bucket = await bucket_host(make_host, tmp_path, persist="on-close")
    heard = Heard()
    h.mount.events.register(heard)
    node = await h.write_file("f", b"one")
    await until(lambda: node.persisted, what="f persisted")
    assert heard.persisted_nodes == [node.guid]
    assert (bucket / "f").read_bytes() == b"one"
    # Recorded in the store too: what a restarted daemon reads.
    row = {r.ino: r for r in h.mount.store.load_inodes()}[node.ino]
    assert row.persisted_version == node.version and row.generation == node.generation


async def test_copies_persisted_records_and_announces() -> None:
    heard = Heard()
    copies = Copies("a", events=heard)
    node = Inode(ino=7, mode=0o100644, uid=0, gid=0, parent=1, name=b"f", version=3,
                 guid="g7", state=CLOSED)
    copies.persisted(node, generation=11, version=3)
    assert node.persisted and node.generation == 11 and heard.persisted_nodes == ["g7"]
    # An older version's object: the generation is recorded, the file is not persisted.
    copies.persisted(node, generation=12, version=2)
    assert node.generation == 12 and node.persisted_version == 3
    # Adopting a further name's object is recorded, not announced.
    node.version = 4
    copies.object_adopted(node, generation=13)
    assert node.persisted_version == 4 and heard.persisted_nodes == ["g7", "g7"]


async def test_deletes_go_markers_first(make_host, tmp_path: Path) -> None:
    h, _ = await bucket_host(make_host, tmp_path, persist="manual")
    d = h.mount.uploader.deletes
    d.later("step_1/shard0", 1)
    d.later("step_1/commit_success.txt", 2)
    d.later("step_1/shard1", 3)
    assert h.mount.uploader.pending_deletes == d.pending
    first = d.next()
    assert first == ("step_1/commit_success.txt", 2)
    # Nothing else while a marker is being deleted.
    d.running.add(first[0])
    assert d.next() is None
    d.running.discard(first[0])
    assert d.next() == ("step_1/shard0", 1)
    assert d.blocks("step_1/shard1") and not d.blocks("step_1/shard0")
    # Pending deletes are kept in the store (they survive a restart).
    assert dict(h.mount.store.load_pending_deletes()) == {
        "step_1/shard0": 1, "step_1/commit_success.txt": 2, "step_1/shard1": 3}


async def test_a_moving_markers_directory_keeps_its_objects_until_the_marker_is_gone(
        make_host, tmp_path: Path) -> None:
    """A step renamed in the bucket (a withdrawal, a tmp directory committed): its files'
    copies may land before its marker's. Their old objects wait until the old marker's
    object is deleted, else a listing in between showed the marker beside files already
    gone (the chaos run's marker_incomplete). Other directories are not held."""
    h, _ = await bucket_host(make_host, tmp_path, persist="manual")
    d = h.mount.uploader.deletes
    d.hold("step_7/.metadata")  # its copy to the new name is under way
    d.later("step_7/__0_0.distcp", 1)  # a file's copy landed first: its old object
    d.later("step_7/sub/__0_1.distcp", 2)
    d.later("step_8/__0_0.distcp", 3)
    assert d.next() == ("step_8/__0_0.distcp", 3)
    assert d.next() is None  # step_7's objects wait for its marker
    d.later("step_7/.metadata", 4)  # the marker's copy landed: its old object goes first
    assert d.next() == ("step_7/.metadata", 4)
    d.running.add("step_7/.metadata")
    assert d.next() is None
    d.running.discard("step_7/.metadata")
    assert {d.next()[0], d.next()[0]} == {"step_7/__0_0.distcp", "step_7/sub/__0_1.distcp"}
    # A marker whose copy found no source is not waited for.
    d.hold("step_9/.metadata")
    d.later("step_9/__0_0.distcp", 5)
    assert d.next() is None
    d.release("step_9/.metadata")
    assert d.next() == ("step_9/__0_0.distcp", 5)


async def test_a_failed_delete_is_pending_again_after_a_backoff(make_host,
                                                               tmp_path: Path) -> None:
    h, bucket = await bucket_host(make_host, tmp_path, persist="manual")
    ns = h.mount.ns

    class Down:
        url = "file:///down"

        def delete(self, key: str, *, if_generation_match: int | None = None) -> None:
            raise Unavailable("the bucket is down")

    stats = Stats()
    backoff = Backoff(stats)
    d = Deletes(ns, Down(), h.mount.fs.rules, backoff, trio.CapacityLimiter(1),
                trio.lowlevel.ParkingLot())
    d.later("x/commit_success.txt", 5)
    assert not await d.run(*d.next())
    assert d.pending == {"x/commit_success.txt": 5} and not d.running
    assert d.next() == ("x/commit_success.txt", 5)  # still a marker: first again
    assert stats.errors == 1 and "the bucket is down" in stats.last_error
    assert 0.4 <= backoff.delay <= MAX_BACKOFF
    backoff.succeeded()
    assert backoff.delay == 0.0


async def test_the_backoff_doubles_up_to_its_limit() -> None:
    backoff = Backoff(Stats())
    delays = []
    for _ in range(12):
        backoff.failed("x")
        delays.append(backoff.delay)
    assert delays[0] <= 0.6 and delays[3] > delays[0]
    assert max(delays) <= MAX_BACKOFF * 1.2 and delays[-1] >= MAX_BACKOFF * 0.8
    assert backoff.stats.errors == 12


async def test_a_marker_waits_for_its_step(make_host, tmp_path: Path) -> None:
    h, _ = await bucket_host(make_host, tmp_path, persist="manual")
    h.mkdir("step_1")
    shard = await h.write_file("step_1/shard", b"x")
    await h.write_file("step_1/tmp.tmp", b"y")  # temporary: no part of the step
    marker = await h.write_file("step_1/commit_success.txt", b"ok")
    accounted = [True]
    markers = Markers(h.mount.ns, h.mount.fs.rules, Links(h.mount.ns), lambda: accounted[0])
    assert markers.unpersisted_in_step(marker) is shard
    assert not markers.may_go(marker) and not markers.step_ready(marker)
    (held,) = markers.status({marker.ino: marker})
    assert held["path"] == "step_1/commit_success.txt" and "step_1/shard" in held["why"]
    assert markers.park_for() == 30.0  # looked at again (and logged) every HELD_LOG s
    h.mount.copies.persisted(shard, 1, shard.version)
    # Every file persisted, but a host is neither alive nor gone for good.
    accounted[0] = False
    assert not markers.may_go(marker) and markers.waiting_for_hosts
    assert "every host" in markers.held[marker.ino][1] and markers.park_for() == 1.0
    accounted[0] = True
    assert markers.may_go(marker) and marker.ino not in markers.held


async def test_uploads_retry_through_an_outage_markers_last(make_host, tmp_path: Path,
                                                          monkeypatch) -> None:
    h, bucket = await bucket_host(make_host, tmp_path, persist="step")
    up = h.mount.uploader
    real_put = up.tier.put_file
    order: list[str] = []
    failures = [2]

    def put_file(key: str, *args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise Unavailable("503 from the bucket")
        order.append(key)
        return real_put(key, *args, **kwargs)

    monkeypatch.setattr(up.tier, "put_file", put_file)
    h.mkdir("step_1")
    for i in range(3):
        await h.write_file(f"step_1/shard{i}", b"x" * 1000)
    await h.write_file("step_1/commit_success.txt", b"ok")
    await until(lambda: h.node("step_1/commit_success.txt").persisted, timeout=30,
                what="the step persisted")
    assert order[-1] == "step_1/commit_success.txt" and len(order) == 4
    assert up.stats.errors == 2 and up.stats.files_uploaded == 4
    assert up.backoff.delay == 0.0 and up.status()["retrying_in"] == 0
    assert (bucket / "step_1" / "commit_success.txt").read_bytes() == b"ok"


async def test_a_rename_of_persisted_files_copies_server_side(make_host,
                                                            tmp_path: Path) -> None:
    h, bucket = await bucket_host(make_host, tmp_path, persist="on-close")
    up = h.mount.uploader
    node = await h.write_file("a", b"payload")
    await until(lambda: node.persisted, what="a persisted")
    uploads = up.stats.files_uploaded
    await h.rename("a", "b")
    await until(lambda: node.persisted and not (bucket / "a").exists(),
                what="b copied, a deleted")
    assert (bucket / "b").read_bytes() == b"payload"
    assert up.stats.copies == 1 and up.stats.files_uploaded == uploads  # no new upload
    assert up.status()["pending_copies"] == 0 and up.idle()


async def test_a_file_moved_by_another_host_is_copied_by_its_uploader(
        make_host, tmp_path: Path) -> None:
    """Another host renamed the directory of a file this host had just persisted,
    before it heard of that object (a withdrawal 5 ms after the upload: chaos seed
    52): this host moves the object to the new name itself. Before, nobody did,
    and a later listing brought the old name back beside the new one."""
    h, bucket = await bucket_host(make_host, tmp_path, persist="on-close")
    up = h.mount.uploader
    h.makedirs("step_7")
    node = await h.write_file("step_7/shard", b"payload")
    await until(lambda: node.persisted, what="step_7/shard persisted")
    uploads = up.stats.files_uploaded
    # The rename as the replicated index applies another host's (mtcfs.peer.index).
    ns = h.mount.ns
    d = h.node("step_7")
    ns.rename(ns.inodes[d.parent], b"step_7", ns.inodes[d.parent], b"step_7.gone")
    h.mount.events.remote_moved(d, "step_7")
    await until(lambda: node.persisted and not (bucket / "step_7" / "shard").exists(),
                what="the object moved to the new name", timeout=20)
    assert (bucket / "step_7.gone" / "shard").read_bytes() == b"payload"
    assert up.stats.copies == 1 and up.stats.files_uploaded == uploads  # no new upload


async def test_a_persisted_directory_renamed_by_another_host_is_copied_once_over(
        make_host, tmp_path: Path) -> None:
    """The common case of the test above: the mover knew of the object and copies it
    too. Whichever copy comes second finds the object there (or its source gone):
    one object under the new name, none under the old, no conflict."""
    from support.peercluster import cluster

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    a, b = await cluster(make_host, 2, bucket=f"file://{bucket}", persist="on-close")
    a.makedirs("d")
    node = await a.write_file("d/f", b"payload", fsync=True)
    await until(lambda: node.persisted and b.exists("d/f") and b.node("d/f").persisted,
                what="d/f persisted, and b heard of it")
    await b.rename("d", "e")
    await until(lambda: a.exists("e/f") and node.persisted
                and (bucket / "e" / "f").exists() and not (bucket / "d" / "f").exists(),
                what="e/f in the bucket, d/f gone", timeout=30)
    assert (bucket / "e" / "f").read_bytes() == b"payload"
    for h in (a, b):
        assert h.mount.uploader.stats.conflicts == 0
        await until(lambda h=h: h.mount.uploader.status()["pending_copies"] == 0,
                    what="no copy left")


async def test_hard_links_get_an_object_per_name(make_host, tmp_path: Path) -> None:
    h, bucket = await bucket_host(make_host, tmp_path, persist="on-close")
    up = h.mount.uploader
    node = await h.write_file("a", b"linked")
    await until(lambda: node.persisted, what="a persisted")
    h.link("a", "b")
    await until(lambda: (bucket / "b").exists() and up.idle(), what="b's object")
    assert (bucket / "b").read_bytes() == b"linked"
    assert up.links.in_step(node)
    h.unlink("b")
    await until(lambda: not (bucket / "b").exists() and up.idle(), what="b's object deleted")
    assert (bucket / "a").exists()


async def test_the_tier_reports_its_retries_to_the_upload_stats(tmp_path: Path) -> None:
    stats = Stats()
    tier = open_durable(f"file://{tmp_path}", on_retry=stats.record_error)
    assert tier.may_hold(1) and not tier.may_hold(0)
    stats.record_error("gs://b: GCS unavailable, retrying")  # as a GCS tier calls it
    assert stats.errors == 1 and stats.last_error.startswith("gs://b")


async def test_a_link_copy_outrun_by_an_unlink_of_the_first_name_keeps_its_object(
        make_host, tmp_path: Path) -> None:
    """The further name's object lands, the file's first name is unlinked before the
    copy returns (CI saw it: the test's unlink came that fast): the object becomes the
    file's own, never a stale further name's object to delete."""
    h, bucket = await bucket_host(make_host, tmp_path, persist="on-close")
    up = h.mount.uploader
    node = await h.write_file("a", b"linked")
    await until(lambda: node.persisted, what="a persisted")
    tier = up.server_copies.tier
    real_copy, landed, go = tier.copy, threading.Event(), threading.Event()

    def slow_copy(*args: Any, **kw: Any) -> Any:
        info = real_copy(*args, **kw)
        landed.set()
        go.wait(10)
        return info

    tier.copy = slow_copy
    h.link("a", "b")
    await until(landed.is_set, what="b's object written")
    h.unlink("a")  # "b" is now the file's only name
    go.set()
    await until(lambda: up.idle() and node.persisted and not (bucket / "a").exists(),
                what="uploads settled")
    await trio.sleep(0.2)
    assert (bucket / "b").read_bytes() == b"linked"
    assert node.generation == tier.stat("b").generation


async def test_a_file_no_host_can_supply_leaves_the_queue_until_a_copy_is_back(
        make_host, tmp_path: Path) -> None:
    """A file this host is to upload whose data is gone here and nowhere else (a
    replacement's predecessor lost it: chaos seed 53) is lost, not queued: the
    queue drains (a settle, `umount --wait`), `mtcfs persist` reports it failed;
    when a copy may be back (a host came back) it is queued again and uploaded."""
    h, bucket = await bucket_host(make_host, tmp_path, persist="manual")
    h.mkdir("step_1")
    node = await h.write_file("step_1/shard", b"weights")
    up = h.mount.uploader
    ram = h.mount.ram
    aside = tmp_path / "aside"
    Path(ram.path(node.ino)).rename(aside)  # its only copy, gone
    node.has_data = False
    assert up.request([node]) == (1, len(b"weights"))
    await until(lambda: up.status()["lost_files"] == 1, what="the file known lost")
    st = up.status()
    assert st["queued_files"] == 0 and st["inflight_files"] == 0 and st["conflicts"] == 0
    assert up.idle()
    assert up.failed[node.ino].startswith("no copy could be fetched")
    assert not (bucket / "step_1" / "shard").exists()

    aside.rename(ram.path(node.ino))  # a copy is back here
    node.has_data = True
    up.peers_changed()
    await until(lambda: node.persisted, what="the file persisted once back")
    assert (bucket / "step_1" / "shard").read_bytes() == b"weights"
    st = up.status()
    assert st["lost_files"] == 0 and node.ino not in up.failed and up.idle()
