"""The durable-tier backends, each against the real thing: gs:// on fake-gcs-server
and file:// on a directory. Every behavioural test runs for both."""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import pytest

from mtcfs.core.checksums import (
    CHUNK_META_KEY,
    IntegrityError,  # every integrity failure (the durable tier's are a subclass)
    chunk_crcs_of_fd,
    chunk_size_for,
    crc32c_combine,
    crc_of_chunks,
    decode_chunk_meta,
    encode_chunk_meta,
)
from mtcfs.tiers.durable import (
    DurableError,
    DurableTier,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Unavailable,
    open_durable,
)
from mtcfs.tiers.durable.base import RangeWriter, parallel_download
from mtcfs.tiers.durable.gcs import GcsTier
from mtcfs.tiers.durable.localdir import XATTR_META, LocalDirTier

from support.gcs_server import GcsServer, closed_port, free_port
from support.link_proxy import LinkProxy

MiB = 1 << 20
GiB = 1 << 30
BACKENDS = ["gs", "file"]


def make_data(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def write_src(dir_: Path, data: bytes, name: str = "src") -> tuple[str, int]:
    path = dir_ / name
    path.write_bytes(data)
    return str(path), google_crc32c.value(data)


def chunk_meta(path: str, chunk_size: int | None = None) -> tuple[int, list[int], str]:
    """(chunk_size, crcs, metadata value) of a local file, as a writer records them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk, crcs = chunk_crcs_of_fd(fd, os.fstat(fd).st_size, chunk_size=chunk_size)
    finally:
        os.close(fd)
    return chunk, crcs, encode_chunk_meta(chunk, crcs)


def open_dest(dir_: Path, name: str = "dest", garbage: int = 0) -> int:
    """A destination fd, pre-filled with garbage the download must not leave behind."""
    fd = os.open(dir_ / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    if garbage:
        os.pwrite(fd, b"\xee" * garbage, 0)
    return fd


@pytest.fixture(params=BACKENDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DurableTier]:
    if request.param == "gs":
        server: GcsServer = request.getfixturevalue("gcs_server")
        bucket = request.getfixturevalue("gcs_bucket")
        t = open_durable(f"gs://{bucket}/run-1", endpoint=server.url, retry_deadline=10)
    else:
        root = tmp_path / "durable"
        root.mkdir()
        t = open_durable(f"file://{root}")
    t.check()
    yield t
    t.close()


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 5 * MiB, 40 * MiB], ids=["0", "1", "5MiB", "40MiB"])
def test_round_trip(tier: DurableTier, tmp_path: Path, size: int) -> None:
    data = make_data(size, seed=size)
    src, crc = write_src(tmp_path, data)
    sent: list[tuple[int, int]] = []
    info = tier.put_file("step-1/shard.bin", src, crc, progress=lambda o, n: sent.append((o, n)))
    assert info.key == "step-1/shard.bin"
    assert info.size == size
    assert info.crc32c == crc
    assert info.generation > 0
    assert sum(n for _, n in sent) == size

    assert tier.stat("step-1/shard.bin") == info
    assert [i.key for i in tier.list()] == ["step-1/shard.bin"]
    assert tier.stat("step-1/missing") is None

    assert tier.read_range("step-1/shard.bin", 0, 10) == data[:10]
    assert tier.read_range("step-1/shard.bin", size // 2, 4096) == data[size // 2:size // 2 + 4096]
    assert tier.read_range("step-1/shard.bin", max(0, size - 5), 100) == data[-5:]
    assert tier.read_range("step-1/shard.bin", size + 10, 100) == b""

    # Chunks of 4 MiB: 40 MiB is 10 ranged GETs over 4 threads.
    fd = open_dest(tmp_path, garbage=size + 1000)
    got: list[tuple[int, int]] = []
    try:
        dl = tier.download("step-1/shard.bin", fd, chunk_size=4 * MiB, parallel=4,
                           progress=lambda o, n: got.append((o, n)))
        assert dl == info
        assert os.fstat(fd).st_size == size
        assert os.pread(fd, size + 1, 0) == data
    finally:
        os.close(fd)
    assert sum(n for _, n in got) == size
    assert sorted(got) == sorted(set(got))  # no range written twice


def test_list_prefix_and_delete(tier: DurableTier, tmp_path: Path) -> None:
    keys = ["a/b/x", "a/bc", "a/b.txt", "b/y", "top"]
    for i, key in enumerate(keys):
        src, crc = write_src(tmp_path, make_data(100 + i, seed=i))
        tier.put_file(key, src, crc)
    assert [i.key for i in tier.list()] == sorted(keys)
    assert [i.key for i in tier.list("a/")] == ["a/b.txt", "a/b/x", "a/bc"]
    assert [i.key for i in tier.list("a/b")] == ["a/b.txt", "a/b/x", "a/bc"]  # string prefix
    assert [i.key for i in tier.list("a/b/")] == ["a/b/x"]
    assert list(tier.list("nothing/")) == []
    assert {i.key: i.size for i in tier.list()} == {k: 100 + i for i, k in enumerate(keys)}

    tier.delete("a/b/x")
    assert tier.stat("a/b/x") is None
    tier.delete("a/b/x")  # absent: not an error
    tier.delete("never/existed", if_generation_match=123)
    assert [i.key for i in tier.list("a/")] == ["a/b.txt", "a/bc"]
    if isinstance(tier, LocalDirTier):
        assert not (Path(tier.root) / "a" / "b").exists()  # emptied directories go too
    with pytest.raises(ObjectNotFound):
        tier.download("a/b/x", open_dest(tmp_path))
    with pytest.raises(ObjectNotFound):
        tier.read_range("a/b/x", 0, 1)


# -- generation preconditions ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1000, 10 * MiB], ids=["multipart", "resumable"])
def test_if_absent_on_existing_key_fails(tier: DurableTier, tmp_path: Path, size: int) -> None:
    v1, v2 = make_data(size, 1), make_data(size, 2)
    src1, crc1 = write_src(tmp_path, v1, "v1")
    src2, crc2 = write_src(tmp_path, v2, "v2")
    first = tier.put_file("k", src1, crc1, if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        tier.put_file("k", src2, crc2, if_generation_match=0)
    assert tier.stat("k") == first
    fd = open_dest(tmp_path)
    try:
        tier.download("k", fd)
        assert os.pread(fd, size + 1, 0) == v1
    finally:
        os.close(fd)


def test_stale_generation_cannot_overwrite(tier: DurableTier, tmp_path: Path) -> None:
    src1, crc1 = write_src(tmp_path, b"one" * 1000, "v1")
    src2, crc2 = write_src(tmp_path, b"two" * 1000, "v2")
    src3, crc3 = write_src(tmp_path, b"three" * 1000, "v3")
    g1 = tier.put_file("k", src1, crc1).generation
    g2 = tier.put_file("k", src2, crc2, if_generation_match=g1).generation
    assert g2 > g1
    with pytest.raises(PreconditionFailed):  # a node that still believes in g1
        tier.put_file("k", src3, crc3, if_generation_match=g1)
    with pytest.raises(PreconditionFailed):
        tier.delete("k", if_generation_match=g1)
    live = tier.stat("k")
    assert live is not None and (live.generation, live.crc32c) == (g2, crc2)
    assert tier.read_range("k", 0, 3) == b"two"
    tier.delete("k", if_generation_match=g2)
    assert tier.stat("k") is None


def test_concurrent_if_absent_puts_one_winner(tier: DurableTier, tmp_path: Path) -> None:
    srcs = [write_src(tmp_path, make_data(2000, seed=i), f"s{i}") for i in range(8)]
    results: list[object] = [None] * len(srcs)
    barrier = threading.Barrier(len(srcs))

    def put(i: int) -> None:
        barrier.wait()
        try:
            results[i] = tier.put_file("race", srcs[i][0], srcs[i][1], if_generation_match=0)
        except PreconditionFailed as e:
            results[i] = e

    threads = [threading.Thread(target=put, args=(i,)) for i in range(len(srcs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [r for r in results if not isinstance(r, PreconditionFailed)]
    assert len(winners) == 1, results
    assert tier.stat("race") == winners[0]


# -- integrity -----------------------------------------------------------------------------------


def test_put_with_wrong_crc_is_refused(tier: DurableTier, tmp_path: Path) -> None:
    src, crc = write_src(tmp_path, make_data(3000))
    with pytest.raises(IntegrityError):
        tier.put_file("bad", src, crc ^ 1)
    assert tier.stat("bad") is None


Corrupt = Callable[..., None]  # corrupt(key, offset=1234567)


@pytest.fixture(params=BACKENDS)
def corruptible(request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[tuple[DurableTier, Corrupt]]:
    """A tier plus corrupt(key[, offset]): flips one stored byte behind the tier's back
    (calling it again flips it back), keeping the recorded crc32c and metadata. For gs://
    that needs fake-gcs-server's filesystem backend, which keeps object bytes as plain
    files (the memory backend recomputes every crc itself)."""
    if request.param == "gs":
        server: GcsServer = request.getfixturevalue("make_gcs_server")("filesystem")
        bucket = server.create_bucket("corrupt-me")
        t: DurableTier = open_durable(f"gs://{bucket}/p", endpoint=server.url,
                                      retry_deadline=10)

        def where(key: str) -> Path:
            return server.object_path(bucket, f"p/{key}")
    else:
        root = tmp_path / "durable"
        root.mkdir()
        t = open_durable(f"file://{root}")

        def where(key: str) -> Path:
            return root / key

    def corrupt(key: str, offset: int = 1234567) -> None:
        path = where(key)
        with open(path, "r+b") as f:  # in place: the xattrs with crc32c and metadata stay
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x01]))

    yield t, corrupt
    t.close()


def test_corrupted_object_is_never_served(corruptible: tuple[DurableTier, Corrupt],
                                          tmp_path: Path) -> None:
    tier, corrupt = corruptible
    data = make_data(3 * MiB, seed=7)
    src, crc = write_src(tmp_path, data)
    tier.put_file("ckpt/shard", src, crc)
    corrupt("ckpt/shard")
    assert tier.read_range("ckpt/shard", 1234567, 1) != data[1234567:1234568]  # really corrupt
    for chunk in (1 * MiB, 8 * MiB):  # several ranged chunks, and one
        fd = open_dest(tmp_path, garbage=100)
        calls: list[tuple[int, int]] = []
        try:
            with pytest.raises(IntegrityError, match="crc32c"):
                tier.download("ckpt/shard", fd, chunk_size=chunk,
                              on_verified=lambda o, n, c=calls: c.append((o, n)))
            assert os.fstat(fd).st_size == 0  # nothing left that could pass for the object
        finally:
            os.close(fd)
        assert calls == []  # no chunk metadata: nothing is reported before the whole matched


# -- custom metadata -------------------------------------------------------------------------------


def test_object_info_metadata_is_frozen() -> None:
    old_style = ObjectInfo("k", 1, None, 7, 0.0)  # positional, as before metadata existed
    assert old_style.metadata == {} and not old_style.metadata
    a = ObjectInfo("k", 1, 5, 7, 0.0, {"x": "1"})
    b = ObjectInfo("k", 1, 5, 7, 0.0, metadata={"x": "1"})
    assert a == b and hash(a) == hash(b) and a != old_style
    assert a.metadata == {"x": "1"} and dict(a.metadata) == {"x": "1"}
    with pytest.raises(TypeError):
        a.metadata["x"] = "2"  # type: ignore[index]


@pytest.mark.parametrize("size", [1000, 10 * MiB], ids=["multipart", "resumable"])
def test_metadata_round_trip(tier: DurableTier, tmp_path: Path, size: int) -> None:
    meta = {"a": "1", "mtcfs-note": "h\u00e9llo w\u00f6rld", CHUNK_META_KEY: "v1:x"}
    src, crc = write_src(tmp_path, make_data(size, seed=11))
    info = tier.put_file("m/obj", src, crc, metadata=meta)
    assert info.metadata == meta
    assert tier.stat("m/obj") == info  # metadata takes part in the comparison
    assert [(i.key, dict(i.metadata)) for i in tier.list("m/")] == [("m/obj", meta)]
    fd = open_dest(tmp_path)
    try:
        assert tier.download("m/obj", fd) == info  # malformed chunk meta: a plain download
    finally:
        os.close(fd)
    # Metadata belongs to one version: a new one without metadata has none.
    plain = tier.put_file("m/obj", src, crc)
    assert plain.metadata == {}
    assert tier.stat("m/obj") == plain
    assert [dict(i.metadata) for i in tier.list("m/")] == [{}]


def test_metadata_limits(tier: DurableTier, tmp_path: Path) -> None:
    src, crc = write_src(tmp_path, b"data")
    for bad in ({"k": "x" * (8 * 1024)}, {"": "v"}, {"a\nb": "v"}, {"k": 1}, {"k": "a\0b"}):
        with pytest.raises(ValueError):
            tier.put_file("k", src, crc, metadata=bad)  # type: ignore[arg-type]
    assert tier.stat("k") is None


def test_largest_chunk_metadata_round_trip(tier: DurableTier, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk crcs of an object with 512 chunks (~4.1 KiB). file:// falls back to a
    compressed xattr where the filesystem refuses the plain one (ext4 refuses ~4 KiB
    here; simulated from 3 KiB on so the test does not depend on the filesystem)."""
    rng = random.Random(512)
    value = encode_chunk_meta(16 * MiB, [rng.getrandbits(32) for _ in range(512)])
    real_setxattr = os.setxattr

    def small_xattrs(fd: int, name: str, value: bytes, *args: object) -> None:
        if name == XATTR_META and len(value) > 3 * 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_setxattr(fd, name, value, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "setxattr", small_xattrs)
    src, crc = write_src(tmp_path, b"tiny")
    info = tier.put_file("k", src, crc, metadata={CHUNK_META_KEY: value})
    assert tier.stat("k") == info and info.metadata[CHUNK_META_KEY] == value
    if isinstance(tier, LocalDirTier):
        assert not os.getxattr(Path(tier.root) / "k", XATTR_META).startswith(b"{")


# -- chunk-verified downloads ----------------------------------------------------------------------


class Recorder:
    """on_verified/progress callbacks that record what a download reports, and check
    at the time of each on_verified call that dest_fd holds exactly the source bytes."""

    def __init__(self, fd: int, data: bytes) -> None:
        self.fd = fd
        self.data = data
        self.verified: list[tuple[int, int]] = []
        self.arrived_at_verify: list[int] = []  # bytes written into fd when reported
        self.correct: list[bool] = []
        self.arrived = 0
        self._lock = threading.Lock()

    def progress(self, off: int, n: int) -> None:
        with self._lock:
            self.arrived += n

    def on_verified(self, off: int, n: int) -> None:
        ok = os.pread(self.fd, n, off) == self.data[off:off + n]
        with self._lock:
            self.verified.append((off, n))
            self.arrived_at_verify.append(self.arrived)
            self.correct.append(ok)


def test_chunked_download_reports_verified_chunks(tier: DurableTier, tmp_path: Path) -> None:
    size = 40 * MiB
    data = make_data(size, seed=40)
    src, crc = write_src(tmp_path, data)
    chunk, crcs, value = chunk_meta(src)
    assert (chunk, len(crcs)) == (16 * MiB, 3) and crc_of_chunks(chunk, crcs, size) == crc
    info = tier.put_file("big", src, crc, metadata={CHUNK_META_KEY: value})
    chunks = [(0, 16 * MiB), (16 * MiB, 16 * MiB), (32 * MiB, 8 * MiB)]
    for parallel in (4, 1):
        fd = open_dest(tmp_path, garbage=size + 1000)
        rec = Recorder(fd, data)
        try:
            # chunk_size is ignored: the object is fetched in its recorded chunks.
            dl = tier.download("big", fd, chunk_size=4 * MiB, parallel=parallel,
                               progress=rec.progress, on_verified=rec.on_verified)
            assert dl == info
            assert os.pread(fd, size + 1, 0) == data
        finally:
            os.close(fd)
        assert sorted(rec.verified) == chunks  # all of [0, size), each byte once
        assert all(rec.correct)  # each range was already in place when reported
        if parallel == 1:
            # One chunk at a time: each was servable before the next had arrived.
            assert rec.verified == chunks
            assert rec.arrived_at_verify == [16 * MiB, 32 * MiB, 40 * MiB]


def _meta_variants(chunk: int, crcs: list[int]) -> dict[str, str | None]:
    good = encode_chunk_meta(chunk, crcs)
    head = f"v1:{chunk}:"
    return {
        "foreign": None,
        "wrong-count": encode_chunk_meta(chunk, crcs[:-1]),
        "extra-crc": encode_chunk_meta(chunk, [*crcs, 0]),
        "non-hex": good[:-1] + "g",
        "upper-hex": head + good[len(head):].upper(),
        "other-chunk-size": encode_chunk_meta(chunk * 2, crcs),
        "bad-version": "v2" + good[2:],
        "garbage": "hello",
        "inconsistent": encode_chunk_meta(chunk, [crcs[0] ^ 1, *crcs[1:]]),  # well-formed, wrong
    }


@pytest.mark.parametrize("kind", list(_meta_variants(1, [0, 0, 0])))
def test_download_without_valid_chunk_meta_verifies_whole(tier: DurableTier, tmp_path: Path,
                                                          kind: str) -> None:
    """A foreign object, or chunk metadata that cannot be trusted: one on_verified(0, size)
    once everything has arrived and matched the object's crc32c."""
    size = 5 * MiB + 123
    data = make_data(size, seed=5)
    src, crc = write_src(tmp_path, data)
    chunk, crcs, _ = chunk_meta(src, chunk_size=1 * MiB)
    value = _meta_variants(chunk, crcs)[kind]
    assert value is None or decode_chunk_meta(value, size) is None or kind == "inconsistent"
    info = tier.put_file("obj", src, crc,
                         metadata=None if value is None else {CHUNK_META_KEY: value})
    fd = open_dest(tmp_path)
    rec = Recorder(fd, data)
    try:
        assert tier.download("obj", fd, chunk_size=1 * MiB, progress=rec.progress,
                             on_verified=rec.on_verified) == info
    finally:
        os.close(fd)
    assert rec.verified == [(0, size)]
    assert rec.arrived_at_verify == [size] and rec.correct == [True]


def test_download_with_small_recorded_chunks(tier: DurableTier, tmp_path: Path) -> None:
    """Any recorded chunk size is used as is (here 1 MiB, last chunk short)."""
    size = 5 * MiB + 123
    data = make_data(size, seed=5)
    src, crc = write_src(tmp_path, data)
    chunk, crcs, value = chunk_meta(src, chunk_size=1 * MiB)
    tier.put_file("obj", src, crc, metadata={CHUNK_META_KEY: value})
    fd = open_dest(tmp_path)
    rec = Recorder(fd, data)
    try:
        tier.download("obj", fd, chunk_size=4 * MiB, on_verified=rec.on_verified)
    finally:
        os.close(fd)
    assert sorted(rec.verified) == [(i * MiB, min(MiB, size - i * MiB)) for i in range(6)]
    assert all(rec.correct)


def test_download_empty_object_reports_once(tier: DurableTier, tmp_path: Path) -> None:
    src, crc = write_src(tmp_path, b"")
    _, crcs, value = chunk_meta(src)
    assert crcs == []
    for meta in ({CHUNK_META_KEY: value}, None):
        tier.put_file("empty", src, crc, metadata=meta)
        fd = open_dest(tmp_path, garbage=10)
        calls: list[tuple[int, int]] = []
        try:
            tier.download("empty", fd, on_verified=lambda o, n, c=calls: c.append((o, n)))
            assert os.fstat(fd).st_size == 0
        finally:
            os.close(fd)
        assert calls == [(0, 0)]


def test_corrupt_chunk_is_never_reported(corruptible: tuple[DurableTier, Corrupt],
                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier, corrupt = corruptible
    size = 40 * MiB
    data = make_data(size, seed=41)
    src, crc = write_src(tmp_path, data)
    _, _, value = chunk_meta(src)
    tier.put_file("big", src, crc, metadata={CHUNK_META_KEY: value})
    bad = 20 * MiB + 12345  # in the second of the chunks [0, 16), [16, 32), [32, 40) MiB
    corrupt("big", bad)
    caplog.set_level(logging.WARNING, logger="mtcfs.tiers.durable.base")
    for parallel in (4, 1):
        fd = open_dest(tmp_path, garbage=100)
        rec = Recorder(fd, data)
        try:
            with pytest.raises(IntegrityError, match="crc32c"):
                tier.download("big", fd, parallel=parallel, progress=rec.progress,
                              on_verified=rec.on_verified)
            assert os.fstat(fd).st_size == 0  # nothing left that could pass for the object
        finally:
            os.close(fd)
        assert not any(off <= bad < off + n for off, n in rec.verified)
        assert all(rec.correct)
        if parallel == 1:
            # The chunk before was served; the one after was never fetched.
            assert rec.verified == [(0, 16 * MiB)]
            assert rec.arrived == 16 * MiB + 2 * 16 * MiB  # the bad chunk came twice
    assert "fetching them again" in caplog.text


def test_chunk_damaged_in_transit_is_fetched_again(corruptible: tuple[DurableTier, Corrupt],
                                                   tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A chunk that arrives damaged once (the byte is repaired as soon as it has been
    read) is fetched again, and the download succeeds."""
    tier, corrupt = corruptible
    size = 12 * MiB
    data = make_data(size, seed=12)
    src, crc = write_src(tmp_path, data)
    _, _, value = chunk_meta(src, chunk_size=4 * MiB)
    info = tier.put_file("obj", src, crc, metadata={CHUNK_META_KEY: value})
    bad = 5 * MiB + 7
    corrupt("obj", bad)
    healed = threading.Event()
    fd = open_dest(tmp_path)
    rec = Recorder(fd, data)

    def progress(off: int, n: int) -> None:
        rec.progress(off, n)
        if off <= bad < off + n and not healed.is_set():
            healed.set()
            corrupt("obj", bad)  # flips it back: the next fetch is good

    caplog.set_level(logging.WARNING, logger="mtcfs.tiers.durable.base")
    try:
        dl = tier.download("obj", fd, progress=progress, on_verified=rec.on_verified)
        # (file:// reports the mtime as `updated`, and corrupt() changed it)
        assert (dl.size, dl.crc32c, dl.generation, dl.metadata) == \
            (info.size, info.crc32c, info.generation, info.metadata)
        assert os.pread(fd, size + 1, 0) == data
    finally:
        os.close(fd)
    assert healed.is_set() and "fetching them again" in caplog.text
    assert sorted(rec.verified) == [(0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 4 * MiB)]
    assert all(rec.correct)


@pytest.mark.serial  # a timing bound: must not share the machine
def test_failed_chunk_stops_the_others(tmp_path: Path) -> None:
    """The first failure aborts the chunks still in transfer (instead of waiting for them),
    raises the cause rather than the siblings' aborts, and leaves no worker writing."""
    fd = open_dest(tmp_path)
    verified: list[tuple[int, int]] = []

    def fetch(w: RangeWriter) -> None:
        if w.start == 0:
            time.sleep(0.05)
            raise IntegrityError("chunk 0 is bad")
        while w.written < w.limit:  # 4 MiB at this pace would take ~0.3 s
            w.write(b"x" * (64 * 1024))
            time.sleep(0.005)

    t0 = time.monotonic()
    try:
        with pytest.raises(IntegrityError, match="chunk 0 is bad"):
            parallel_download(fd, 16 * MiB, 4 * MiB, 4, fetch, None, chunk_crcs=[0, 0, 0, 0],
                              on_verified=lambda o, n: verified.append((o, n)))
    finally:
        os.close(fd)
    assert time.monotonic() - t0 < 0.25
    assert verified == []
    assert not [t for t in threading.enumerate() if t.name.startswith("mtcfs-dl")]


# -- chunk metadata helpers ------------------------------------------------------------------------


def test_chunk_size_for() -> None:
    assert chunk_size_for(0) == chunk_size_for(1) == chunk_size_for(16 * MiB) == 16 * MiB
    assert chunk_size_for(8 * GiB) == 16 * MiB  # exactly 512 chunks
    assert chunk_size_for(8 * GiB + 1) == 32 * MiB
    assert chunk_size_for(20 * GiB) == 64 * MiB
    for size in (1, 16 * MiB + 1, 3 * GiB, 8 * GiB, 8 * GiB + 1, 20 * GiB, 1 << 40, 5 << 40):
        chunk = chunk_size_for(size)
        assert chunk % (16 * MiB) == 0 and chunk & (chunk - 1) == 0
        assert -(-size // chunk) <= 512
        assert chunk == 16 * MiB or -(-size // (chunk // 2)) > 512  # the smallest that fits
    with pytest.raises(ValueError):
        chunk_size_for(-1)


@pytest.mark.parametrize("size", [0, 1, 16 * MiB, 16 * MiB + 1, 8 * GiB, 20 * GiB, 1 << 40])
def test_chunk_meta_encode_decode(size: int) -> None:
    rng = random.Random(size)
    chunk = chunk_size_for(size)
    crcs = [rng.getrandbits(32) for _ in range(-(-size // chunk))]
    crcs[:2] = [0, 0xFFFFFFFF][:len(crcs)]
    value = encode_chunk_meta(chunk, crcs)
    assert decode_chunk_meta(value, size) == (chunk, crcs)
    # GCS: all custom metadata, keys and values, within 8 KiB.
    assert len(CHUNK_META_KEY.encode()) + len(value.encode()) < 8 * 1024
    if size == 20 * GiB:
        assert (chunk, len(crcs)) == (64 * MiB, 320) and len(value) < 3 * 1024


def test_chunk_meta_decode_is_strict() -> None:
    size = 40 * MiB
    crcs = [0x12345678, 0x9ABCDEF0, 0x0000000F]
    good = encode_chunk_meta(16 * MiB, crcs)
    assert good == "v1:16777216:123456789abcdef00000000f"
    assert decode_chunk_meta(good, size) == (16 * MiB, crcs)
    assert decode_chunk_meta(good, 32 * MiB + 1) == (16 * MiB, crcs)
    bad = [
        encode_chunk_meta(16 * MiB, crcs[:2]),  # too few for the size
        encode_chunk_meta(16 * MiB, [*crcs, 1]),  # too many
        good[:-1] + "g", good[:-1] + "F", good[:-1],  # non-hex, upper case, 7 digits
        "v1:16777216:12345678,9abcdef0,0000000f", good + " ", " " + good, good + "\n",
        "v2" + good[2:], "v1:0:", "v1:-16777216:" + good[12:], "v1:016777216:" + good[12:],
        "v1:\u0661\u0666:" + good[12:], "v1:16777216", "", "hello",
    ]
    for value in bad:
        assert decode_chunk_meta(value, size) is None, value
    assert decode_chunk_meta(good, 32 * MiB) is None  # two chunks' worth of size
    assert decode_chunk_meta(good, -1) is None
    assert decode_chunk_meta(None, size) is None  # type: ignore[arg-type]
    assert decode_chunk_meta(good.encode(), size) is None  # type: ignore[arg-type]
    assert decode_chunk_meta("v1:16777216:", 0) == (16 * MiB, [])
    for chunk, bad_crcs in ((0, []), (-1, []), (16 * MiB, [1 << 32]), (16 * MiB, [-1])):
        with pytest.raises(ValueError):
            encode_chunk_meta(chunk, bad_crcs)


def test_chunk_crcs_of_fd(tmp_path: Path) -> None:
    data = make_data(10 * MiB + 5, seed=3)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        chunk, crcs = chunk_crcs_of_fd(fd, len(data), chunk_size=4 * MiB)
        assert chunk == 4 * MiB
        assert crcs == [google_crc32c.value(data[o:o + chunk]) for o in range(0, len(data), chunk)]
        assert crc_of_chunks(chunk, crcs, len(data)) == google_crc32c.value(data)
        assert chunk_crcs_of_fd(fd, len(data)) == (16 * MiB, [google_crc32c.value(data)])
        assert chunk_crcs_of_fd(fd, 100) == (16 * MiB, [google_crc32c.value(data[:100])])
        assert chunk_crcs_of_fd(fd, 0) == (16 * MiB, [])
        with pytest.raises(IntegrityError, match="ended at byte"):
            chunk_crcs_of_fd(fd, len(data) + 1)
    finally:
        os.close(fd)


# -- check() ---------------------------------------------------------------------------------------


def test_check_missing_bucket(gcs_server: GcsServer) -> None:
    t0 = time.monotonic()
    with pytest.raises(DurableError, match=r"gs://no-such-bucket-1/x: bucket 'no-such-bucket-1' "
                                           r"does not exist"):
        open_durable("gs://no-such-bucket-1/x", endpoint=gcs_server.url).check()
    assert time.monotonic() - t0 < 10


def test_check_unreachable_endpoint() -> None:
    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(DurableError, match=rf"cannot reach GCS at http://127.0.0.1:{port}: "
                                           r"connection refused"):
        open_durable("gs://some-bucket", endpoint=f"127.0.0.1:{port}").check()
    assert time.monotonic() - t0 < 10


def test_check_hung_endpoint() -> None:
    """A server that accepts connections but never answers: bounded, not a hang."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as hung:
        port = hung.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(DurableError, match=rf"cannot reach GCS at http://127.0.0.1:{port}: "
                                               r"timed out"):
            open_durable("gs://some-bucket", endpoint=f"http://127.0.0.1:{port}").check()
        assert time.monotonic() - t0 < 10


def test_check_uses_storage_emulator_host(gcs_server: GcsServer, gcs_bucket: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    open_durable(f"gs://{gcs_bucket}").check()


def test_check_local_dir(tmp_path: Path) -> None:
    with pytest.raises(DurableError, match="directory does not exist"):
        open_durable(f"file://{tmp_path}/missing").check()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DurableError, match="not a directory"):
        open_durable(f"file://{tmp_path}/afile").check()
    open_durable(f"file://{tmp_path}").check()
    assert not list(tmp_path.glob(".mtcfs-tmp-*"))  # the probe is cleaned up


# -- outages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 4 * MiB], ids=["streamed", "chunked"])
def test_upload_survives_server_restart(make_gcs_server: Callable[..., GcsServer],
                                        tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                        chunk: int | None) -> None:
    server = make_gcs_server("memory")
    bucket = server.create_bucket("outage")
    tier = GcsTier(bucket, "p/", endpoint=server.url, retry_deadline=20,
                   upload_chunk_size=chunk)
    data = make_data(24 * MiB, seed=3)
    src, crc = write_src(tmp_path, data)
    killed = threading.Event()
    restarter: list[threading.Thread] = []

    def progress(off: int, n: int) -> None:
        # Crash the server once a third of the file is on its way, bring it back 1.5 s later.
        if off >= 8 * MiB and not killed.is_set():
            killed.set()
            server.kill()
            t = threading.Thread(target=server.restart, kwargs={"downtime": 1.5})
            t.start()
            restarter.append(t)

    caplog.set_level(logging.WARNING, logger="mtcfs.tiers.durable.gcs")
    t0 = time.monotonic()
    info = tier.put_file("big", src, crc, progress=progress)
    elapsed = time.monotonic() - t0
    for t in restarter:
        t.join()
    assert killed.is_set()
    assert info.crc32c == crc and info.size == len(data)
    assert "restarting the upload" in caplog.text  # the lost session was started over
    assert elapsed < 30
    fd = open_dest(tmp_path)
    try:
        tier.download("big", fd, chunk_size=4 * MiB)
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
    tier.close()


def test_download_survives_server_restart(make_gcs_server: Callable[..., GcsServer],
                                          tmp_path: Path) -> None:
    """The filesystem backend keeps objects over a restart, as GCS would: the ranged
    downloads interrupted by the crash resume where they stopped."""
    server = make_gcs_server("filesystem")
    bucket = server.create_bucket("outage")
    tier = open_durable(f"gs://{bucket}", endpoint=server.url, retry_deadline=20)
    data = make_data(24 * MiB, seed=9)
    src, crc = write_src(tmp_path, data)
    tier.put_file("obj", src, crc)
    killed = threading.Event()
    restarter: list[threading.Thread] = []

    def progress(off: int, n: int) -> None:
        if not killed.is_set():
            killed.set()
            server.kill()
            t = threading.Thread(target=server.restart, kwargs={"downtime": 1.0})
            t.start()
            restarter.append(t)

    fd = open_dest(tmp_path)
    try:
        info = tier.download("obj", fd, chunk_size=4 * MiB, parallel=4, progress=progress)
        assert info.crc32c == crc
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
        for t in restarter:
            t.join()
    assert killed.is_set()
    tier.close()


def test_upload_resumes_after_dropped_connection(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A connection cut mid-upload: the session's status is queried. fake-gcs-server
    finalizes the session on that query with partial data; the tier notices the short
    object, removes it, and uploads again (on GCS the upload would resume instead)."""
    proxy_port = free_port()
    server = GcsServer("memory", external_url=f"http://127.0.0.1:{proxy_port}").start()
    proxy = LinkProxy(server.port, drop_after=12 * MiB, port=proxy_port)
    try:
        bucket = server.create_bucket("flaky")
        tier = open_durable(f"gs://{bucket}", endpoint=proxy.url, retry_deadline=10)
        data = make_data(24 * MiB, seed=5)
        src, crc = write_src(tmp_path, data)
        caplog.set_level(logging.WARNING, logger="mtcfs.tiers.durable.gcs")
        info = tier.put_file("obj", src, crc)
        assert proxy.dropped.is_set()
        assert "finalized the upload early" in caplog.text
        assert (info.size, info.crc32c) == (len(data), crc)
        assert [i.generation for i in tier.list()] == [info.generation]
        fd = open_dest(tmp_path)
        try:
            tier.download("obj", fd)
            assert os.pread(fd, len(data) + 1, 0) == data
        finally:
            os.close(fd)
        tier.close()
    finally:
        proxy.close()
        server.stop()


def test_upload_gives_up_after_retry_deadline(make_gcs_server: Callable[..., GcsServer],
                                              tmp_path: Path) -> None:
    server = make_gcs_server("memory")
    bucket = server.create_bucket("outage")
    tier = open_durable(f"gs://{bucket}", endpoint=server.url, retry_deadline=3)
    src, crc = write_src(tmp_path, make_data(20 * MiB))
    server.kill()
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=r"gs://outage: put k: GCS at .* unavailable.*"
                                          r"connection refused"):
        tier.put_file("k", src, crc)
    assert time.monotonic() - t0 < 10
    server.start()
    assert tier.put_file("k", src, crc).crc32c == crc  # and works again once it is back
    tier.close()


# -- keys and URLs -------------------------------------------------------------------------------


BAD_KEYS = ["", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a/.", "a\0b", "a\nb",
            "x" * 1025, "\udcff"]


def test_invalid_keys_rejected(tier: DurableTier, tmp_path: Path) -> None:
    src, crc = write_src(tmp_path, b"data")
    fd = open_dest(tmp_path)
    try:
        for key in BAD_KEYS:
            for call in (lambda k: tier.put_file(k, src, crc), tier.stat, tier.delete,
                         lambda k: tier.read_range(k, 0, 1), lambda k: tier.download(k, fd)):
                with pytest.raises(ValueError):
                    call(key)
    finally:
        os.close(fd)
    assert list(tier.list()) == []
    longest = "/".join(["y" * 200] * 4 + ["z" * 220])  # 1024 bytes, segments within NAME_MAX
    assert len(longest) == 1024
    assert tier.put_file(longest, src, crc).key == longest


def test_local_reserved_names(tmp_path: Path) -> None:
    t = open_durable(f"file://{tmp_path}")
    src, crc = write_src(tmp_path, b"data", "s")
    for key in (".mtcfs-locks/x", "a/.mtcfs-tmp-123"):
        with pytest.raises(ValueError, match="reserved"):
            t.put_file(key, src, crc)


@pytest.mark.parametrize("url", ["s3://bucket/x", "gs://", "gs://AB", "gs://bucket/a/../b",
                                 "file://relative/dir", "file:///", "/plain/path", "bucket"])
def test_open_durable_rejects_bad_urls(url: str) -> None:
    with pytest.raises(DurableError) as e:
        open_durable(url)
    assert "\n" not in str(e.value) and url.split("/")[0] in str(e.value)


def test_open_durable_parses_urls(tmp_path: Path) -> None:
    t = open_durable("gs://my-bucket/some/prefix/", endpoint="http://127.0.0.1:1")
    assert isinstance(t, GcsTier) and (t.bucket_name, t.prefix) == ("my-bucket", "some/prefix/")
    assert t.url == "gs://my-bucket/some/prefix"
    assert isinstance(open_durable(f"file://{tmp_path}"), LocalDirTier)
    assert open_durable("file://localhost/srv/ckpt").url == "file:///srv/ckpt"


def test_crc32c_combine() -> None:
    rng = random.Random(1)
    for _ in range(50):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.randrange(0, 5000))
        assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == \
            google_crc32c.value(a + b)
