"""Versions (mtcfs.core.versions), the one writer of a file's state, version and
checksums, in-process: its rules on their own, then as each writer uses them: the
replicated index's merges (newer, older, equal versions, a file rewritten here),
the bucket listing against local files, and start-up over what a crashed daemon
left (open, sealing, lost files)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import google_crc32c
import pytest

from mtcfs.core.checksums import block_crcs_of_fd
from mtcfs.core.namespace import CLOSED, INCOMPLETE, OPEN, SEALING, Inode
from mtcfs.core.versions import Versions
from mtcfs.fs.filesystem import FsError
from mtcfs.tiers.durable import ObjectInfo

from support import simnet
from support.inprocess import Host
from support.onemount import crash, mount_at, pt_write, remounted_after_a_crash_mid_write

pytestmark = pytest.mark.nofuse


def crc(data: bytes) -> int:
    return google_crc32c.value(data)


def sealed_file(version: int = 1, data: bytes = b"data", author: str = "a") -> Inode:
    """An inode of a file sealed here (as a seal leaves it)."""
    node = Inode(2, stat.S_IFREG | 0o644, 0, 0, 1, b"f", size=len(data))
    node.author, node.sealed_size = author, len(data)
    Versions.adopted(node, version, len(data), crc(data), b"blocks", author)
    return node


# -- the rules -------------------------------------------------------------------------------


def test_a_first_seal_is_version_1() -> None:
    node = Inode(2, stat.S_IFREG | 0o644, 0, 0, 1, b"f", state=OPEN, size=4)
    assert Versions("a").sealed(node, crc(b"data"), b"b") is True
    assert (node.state, node.version, node.crc32c, node.block_crcs, node.sealed_size) == (
        CLOSED, 1, crc(b"data"), b"b", 4)


def test_a_seal_of_the_same_content_keeps_the_version() -> None:
    node = sealed_file(3)
    assert Versions("a").sealed(node, crc(b"data"), b"blocks") is False
    assert node.version == 3 and node.state == CLOSED


def test_a_seal_of_new_content_is_the_next_version() -> None:
    node = sealed_file(3)
    node.size = 5
    assert Versions("a").sealed(node, crc(b"data!"), b"other") is True
    assert node.version == 4 and node.crc32c == crc(b"data!") and node.sealed_size == 5


@pytest.mark.parametrize("how", ["cached", "another author", "incomplete", "other size"])
def test_the_same_checksum_is_still_a_new_version_when(how: str) -> None:
    """Only this host's own sealed data, unchanged, keeps its version: a cache copy,
    another host's version, an incomplete file or a size the checksum was not for
    are sealed as a version of this host's."""
    node = sealed_file(2)
    if how == "cached":
        node.cached = True
    elif how == "another author":
        node.author = "b"
    elif how == "incomplete":
        Versions.lost(node)
    else:
        node.sealed_size = 3
    assert Versions("a").sealed(node, crc(b"data"), b"blocks") is True
    assert node.version == 3 and node.state == CLOSED


def test_writing_and_closing_say_whether_the_state_changed() -> None:
    node = sealed_file()
    assert Versions.writing(node) is True and node.state == OPEN
    assert Versions.writing(node) is False
    assert Versions.closing(node) is True and node.state == SEALING
    assert Versions.closing(node) is False
    assert node.version == 1 and node.crc32c == crc(b"data")  # neither touches those


def test_recovered_data_is_the_same_version_or_the_next() -> None:
    same = sealed_file(2)
    Versions.writing(same)
    assert Versions.recovered(same, 4, crc(b"data"), b"blocks", same_version=True) is False
    assert same.state == CLOSED and same.version == 2
    closed_unsealed = sealed_file(2)
    Versions.closing(closed_unsealed)
    assert Versions.recovered(closed_unsealed, 5, crc(b"data!"), b"x",
                              same_version=False) is True
    assert (closed_unsealed.version, closed_unsealed.size, closed_unsealed.crc32c) == (
        3, 5, crc(b"data!"))
    unchanged = sealed_file(2)
    Versions.closing(unchanged)
    assert Versions.recovered(unchanged, 4, crc(b"data"), b"blocks",
                              same_version=False) is False
    assert unchanged.version == 2


def test_interrupted_forgets_the_checksum_and_lost_keeps_it() -> None:
    interrupted, lost = sealed_file(), sealed_file()
    Versions.interrupted(interrupted)
    Versions.lost(lost)
    assert interrupted.state == lost.state == INCOMPLETE
    assert interrupted.crc32c is None and lost.crc32c == crc(b"data")


def test_the_buckets_object_is_version_1_or_the_next_of_what_it_replaces() -> None:
    fresh = Inode(3, stat.S_IFREG | 0o644, 0, 0, 1, b"g", state=OPEN)
    Versions.from_bucket(fresh, 10, 0xABC)
    assert (fresh.state, fresh.version, fresh.size, fresh.crc32c) == (CLOSED, 1, 10, 0xABC)
    newer = Inode(4, stat.S_IFREG | 0o644, 0, 0, 1, b"h", state=OPEN)
    Versions.from_bucket(newer, 1, 0x1, replaces=4)
    assert newer.version == 5
    known = sealed_file(3)
    Versions.from_bucket(known, 4, crc(b"data"))
    assert known.version == 3  # never lowered


def test_same_content_is_version_size_and_checksum() -> None:
    node = sealed_file(2)
    assert Versions.same_content(node, 2, 4, crc(b"data"))
    assert not Versions.same_content(node, 3, 4, crc(b"data"))
    assert not Versions.same_content(node, 2, 5, crc(b"data"))
    assert not Versions.same_content(node, 2, 4, None)


# -- the replicated index ------------------------------------------------------------------


def file_entry(version: int, lamport: int, data: bytes, writer: str = "h1",
               holders: tuple[str, ...] = ("h1",)):
    e = simnet.entry("f1", "d0", "shard", lamport, writer, size=len(data))
    e.version, e.crc32c = version, crc(data)
    e.block_crcs = crc(data).to_bytes(4, "little")
    del e.holders[:]
    e.holders.extend(holders)
    return e


def index_with_a_file(tmp_path: Path, version: int = 1, data: bytes = b"one"):
    store = simnet.IndexStore("h0", str(tmp_path / "h0"))
    store.index.apply([simnet.entry("d0", "root", "step_1", 10, "h1", is_dir=True),
                       file_entry(version, 11, data)])
    return store


def shard(store: simnet.IndexStore) -> Inode:
    node = store.index.ns.by_global_id("f1")
    assert node is not None
    return node


def test_a_file_from_the_index_is_that_hosts_sealed_version(tmp_path: Path) -> None:
    store = index_with_a_file(tmp_path)
    node = shard(store)
    assert (node.state, node.version, node.crc32c, node.author) == (CLOSED, 1, crc(b"one"), "h1")
    assert node.block_crcs == crc(b"one").to_bytes(4, "little") and not node.has_data
    store.close()


def test_a_newer_version_from_the_index_replaces_the_content(tmp_path: Path) -> None:
    store = index_with_a_file(tmp_path)
    old = shard(store)
    assert store.index.apply([file_entry(2, 20, b"two!", writer="h2", holders=("h2",))]) == 1
    node = shard(store)
    assert node is not old and old.stale  # new content: a new inode at the name
    assert (node.version, node.size, node.crc32c, node.author) == (2, 4, crc(b"two!"), "h2")
    assert node.state == CLOSED and node.holders == ["h2"]
    store.close()


def test_an_older_entry_leaves_the_newer_version(tmp_path: Path) -> None:
    store = index_with_a_file(tmp_path)
    store.index.apply([file_entry(2, 20, b"two!")])
    ignored = store.index.stats.ignored
    assert store.index.apply([file_entry(1, 11, b"one")]) == 0
    node = shard(store)
    assert node.version == 2 and node.crc32c == crc(b"two!")
    assert store.index.stats.ignored == ignored + 1
    store.close()


def test_the_same_version_from_another_host_merges_its_holders(tmp_path: Path) -> None:
    store = index_with_a_file(tmp_path)
    before = shard(store)
    assert store.index.apply([file_entry(1, 11, b"one", holders=("h1", "h2"))]) == 1
    node = shard(store)
    assert node is before and node.version == 1 and node.crc32c == crc(b"one")
    assert sorted(node.holders) == ["h1", "h2"]
    store.close()


def test_a_newer_entry_waits_while_the_file_is_rewritten_here(tmp_path: Path) -> None:
    store = index_with_a_file(tmp_path)
    node = shard(store)
    node.dirty = True  # a writer here: our seal will be newer
    assert store.index.apply([file_entry(2, 20, b"two!")]) == 0
    assert shard(store) is node and node.version == 1 and node.crc32c == crc(b"one")
    store.close()


# -- the bucket listing and start-up -------------------------------------------------------


def obj(key: str, data: bytes, generation: int) -> ObjectInfo:
    return ObjectInfo(key, len(data), crc(data), generation, 1_700_000_000.0)


@pytest.fixture
def bucketed(tmp_path: Path):
    (tmp_path / "bucket").mkdir()
    m = mount_at(tmp_path, bucket=f"file://{tmp_path / 'bucket'}")
    yield Host(m)
    crash(m)


@pytest.mark.trio
async def test_an_object_only_in_the_bucket_is_version_1_not_here(bucketed) -> None:
    h: Host = bucketed
    assert h.mount.listing.merge([obj("step_1/shard", b"remote", 7)], set(), full=False) == 1
    node = h.node("step_1/shard")
    assert (node.state, node.version, node.size, node.crc32c) == (CLOSED, 1, 6, crc(b"remote"))
    assert node.persisted and node.generation == 7 and not node.has_data


@pytest.mark.trio
async def test_a_newer_object_replaces_a_persisted_file_with_the_next_version(
        bucketed) -> None:
    h: Host = bucketed
    listing = h.mount.listing
    listing.merge([obj("f", b"first", 7)], set(), full=False)
    old = h.node("f")
    listing.merge([obj("f", b"second!", 8)], set(), full=False)
    node = h.node("f")
    assert node is not old and old.stale
    assert (node.version, node.crc32c, node.generation) == (2, crc(b"second!"), 8)
    assert node.persisted and node.persisted_version == 2


@pytest.mark.trio
async def test_an_object_unlike_an_unpersisted_local_file_leaves_the_local_one(
        bucketed) -> None:
    h: Host = bucketed
    await h.write_file("f", b"local bytes")
    h.mount.listing.merge([obj("f", b"bucket bytes", 9)], set(), full=False)
    node = h.node("f")
    assert node.crc32c == crc(b"local bytes") and node.version == 1 and not node.persisted
    assert await h.read_file("f") == b"local bytes"


@pytest.mark.trio
async def test_an_object_with_the_local_bytes_is_adopted_as_persisted(bucketed) -> None:
    """Our upload landed just before a crash: the same bytes, now known persisted."""
    h: Host = bucketed
    await h.write_file("f", b"same bytes")
    h.mount.listing.merge([obj("f", b"same bytes", 9)], set(), full=False)
    node = h.node("f")
    assert node.version == 1 and node.persisted and node.generation == 9 and node.has_data


@pytest.mark.trio
async def test_a_file_written_when_the_daemon_died_is_incomplete(tmp_path: Path) -> None:
    m = await remounted_after_a_crash_mid_write(tmp_path)
    h = Host(m)
    node = h.node("f")
    assert node.state == INCOMPLETE and node.crc32c is None
    assert h.state("f")["state"] == "incomplete"
    with pytest.raises(FsError) as e:
        await h.fs.open(node, os.O_RDONLY)
    assert e.value.errno == errno.EIO
    await h.write_file("f", b"rewritten")  # O_TRUNC: a rewrite makes it good again
    assert h.node("f").state == CLOSED and h.node("f").crc32c == crc(b"rewritten")
    crash(m)


@pytest.mark.trio
async def test_a_write_that_left_the_bytes_as_sealed_keeps_its_version(
        tmp_path: Path) -> None:
    m = mount_at(tmp_path)
    h = Host(m)
    await h.write_file("f", b"same")
    fh = await h.open("f", os.O_WRONLY)
    await h.write(fh, 0, b"sa")  # recorded open, the bytes as they were
    crash(m)
    m = mount_at(tmp_path)
    node = Host(m).node("f")
    assert (node.state, node.version, node.crc32c) == (CLOSED, 1, crc(b"same"))
    crash(m)


@pytest.mark.trio
async def test_a_file_closed_through_passthrough_is_sealed_at_start(tmp_path: Path) -> None:
    m = mount_at(tmp_path, passthrough=True)
    h = Host(m)
    await h.write_file("f", b"v1")
    fh = await h.fs.open(h.node("f"), os.O_WRONLY)
    pt_write(h, fh, 0, b"v2 via the kernel")
    await h.fs.flush(fh)
    assert h.node("f").state == SEALING
    crash(m)  # before the release's seal
    m = mount_at(tmp_path)
    h = Host(m)
    node = h.node("f")
    assert (node.state, node.version, node.crc32c) == (CLOSED, 2, crc(b"v2 via the kernel"))
    fd = m.ram.open_read(node.ino)
    try:
        assert (node.crc32c, node.block_crcs) == block_crcs_of_fd(fd, node.size)
    finally:
        os.close(fd)
    crash(m)


@pytest.mark.trio
async def test_a_sealed_file_whose_only_copy_is_gone_is_incomplete(tmp_path: Path) -> None:
    m = mount_at(tmp_path)
    h = Host(m)
    await h.write_file("f", b"only copy")
    ino = h.node("f").ino
    path = m.ram.path(ino)
    crash(m)
    os.unlink(path)
    m = mount_at(tmp_path)
    node = Host(m).node("f")
    assert node.state == INCOMPLETE and node.crc32c == crc(b"only copy")  # what it was
    assert not node.has_data
    crash(m)


@pytest.mark.trio
async def test_a_steps_objects_under_its_other_name_are_not_merged(bucketed) -> None:
    """A withdrawn (or reinstated) step's objects under its old name stay in the bucket
    until the renaming host's deletes run (GCS down meanwhile): a listing must not bring
    back a stale copy of the step beside the known one. A fresh host, which knows
    neither name, takes both (the job may have saved the step again)."""
    h: Host = bucketed
    listing = h.mount.listing
    assert listing.merge([obj("step_4.mtcfs-withdrawn/shard", b"kept", 3)], set(),
                         full=False) == 1
    assert listing.merge([obj("step_4/shard", b"kept", 2),
                          obj("step_4/.metadata", b"m", 2)], set(), full=False) == 0
    assert not h.exists("step_4")
    assert listing.merge([obj("step_5/shard", b"back", 4),
                          obj("step_5/.metadata", b"m", 4)], set(), full=False) == 2
    assert listing.merge([obj("step_5.mtcfs-withdrawn/shard", b"back", 1),
                          obj("step_5/.metadata.mtcfs-withdrawn", b"m", 1)], set(),
                         full=False) == 0
    assert not h.exists("step_5.mtcfs-withdrawn")
    assert not h.exists("step_5/.metadata.mtcfs-withdrawn")
    # Both names new here, in one listing: both merged.
    assert listing.merge([obj("step_6.mtcfs-withdrawn/shard", b"old", 5),
                          obj("step_6/shard", b"new", 6)], set(), full=False) == 2
    assert h.exists("step_6") and h.exists("step_6.mtcfs-withdrawn")


@pytest.mark.trio
async def test_a_listed_ghost_whose_object_is_gone_is_removed_on_every_host(bucketed) -> None:
    """A host with an empty RAM dir listed the bucket while a reinstated step's objects
    under its withdrawn name were not deleted yet: it merged both names and announced
    them (a chaos run: `step_756.mtcfs-withdrawn/` stood beside the step on every host
    for good, and a restart's listing dropped it on that host only). Once the object
    is gone, a refresh removes such an entry, known only from a listing with no copy
    anywhere, through the filesystem's removal: a tombstone every host applies."""
    from mtcfs.core.events import Listener

    class Removals(Listener):
        def __init__(self) -> None:
            self.paths: list[str] = []

        def removed(self, node: Inode, path: str) -> None:
            self.paths.append(path)

    h: Host = bucketed
    seen = Removals()
    h.mount.events.register(seen)
    listing = h.mount.listing
    assert listing.merge([obj("step_6.mtcfs-withdrawn/shard", b"old", 5),
                          obj("step_6/shard", b"new", 6)], set(), full=False) == 2
    await h.write_file("step_6/mine", b"written here")  # a real file: kept
    assert listing.merge([obj("step_6/shard", b"new", 6)], set(), full=False) == 1
    assert not h.exists("step_6.mtcfs-withdrawn")
    assert h.exists("step_6/shard") and h.exists("step_6/mine")
    assert seen.paths == ["step_6.mtcfs-withdrawn/shard", "step_6.mtcfs-withdrawn"]
    # The live name's object gone too: its ghost goes, the directory with a real file stays.
    listing.merge([], set(), full=False)
    assert not h.exists("step_6/shard") and h.exists("step_6/mine")
