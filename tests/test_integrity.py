"""Per-block crc32c: combine, streaming, resume, one pass over an fd, range checks."""

from __future__ import annotations

import os
import random
import time

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtcfs.core.checksums import (
    BLOCK,
    StreamingCrc,
    block_count,
    block_crcs_of_fd,
    crc32c_combine,
    crc32c_of_fd,
    format_crc,
    pack_crcs,
    unpack_crcs,
    verify_range,
)

SMALL = 64  # a small block keeps many-block cases fast


def crc(b: bytes) -> int:
    return google_crc32c.value(b)


def ref_blocks(data: bytes, block: int) -> bytes:
    return pack_crcs([crc(data[i:i + block]) for i in range(0, len(data), block)])


def chunks(data: bytes, sizes: list[int]) -> list[tuple[int, bytes]]:
    """Split data into sequential (off, buf) writes of the given sizes (cycled)."""
    out, off, i = [], 0, 0
    while off < len(data):
        n = sizes[i % len(sizes)] if sizes else len(data)
        out.append((off, data[off:off + n]))
        off += n
        i += 1
    return out


# -- crc32c_combine --------------------------------------------------------------------------------


@given(st.binary(max_size=2000), st.data())
@settings(max_examples=300, deadline=None)
def test_combine_random_splits(data: bytes, draw: st.DataObject) -> None:
    cut = draw.draw(st.integers(0, len(data)))
    a, b = data[:cut], data[cut:]
    assert crc32c_combine(crc(a), crc(b), len(b)) == crc(data)
    # A second use of the same length goes through the cached tables.
    assert crc32c_combine(crc(a), crc(b), len(b)) == crc(data)


def test_combine_empty_parts() -> None:
    x = os.urandom(100)
    assert crc32c_combine(crc(x), crc(b""), 0) == crc(x)
    assert crc32c_combine(crc(b""), crc(x), len(x)) == crc(x)
    assert crc32c_combine(0, 0, 0) == 0
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, -1)


@pytest.mark.parametrize("len2", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3])
def test_combine_around_block(len2: int) -> None:
    a, b = os.urandom(1000), os.urandom(len2)
    for _ in range(3):  # one-off path, then table build, then cached tables
        assert crc32c_combine(crc(a), crc(b), len2) == crc(a + b)


# -- StreamingCrc ----------------------------------------------------------------------------------


@given(st.binary(max_size=1500), st.lists(st.integers(0, 200), min_size=1, max_size=8))
@settings(max_examples=300, deadline=None)
def test_streaming_matches_reference(data: bytes, sizes: list[int]) -> None:
    if not any(sizes):
        sizes = [1]
    s = StreamingCrc(block=SMALL)
    for off, buf in chunks(data, sizes):
        s.update(off, buf)
        # Repeated mid-stream queries use and extend the cached prefix.
        assert s.result(off + len(buf)) == crc(data[:off + len(buf)])
    assert s.result(len(data)) == crc(data)
    assert s.result(len(data)) == crc(data)
    assert s.blocks(len(data)) == ref_blocks(data, SMALL)
    assert s.result(len(data) + 1) is None and s.blocks(len(data) + 1) is None


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5])
@pytest.mark.parametrize("step", [1 << 20, 3 << 20, 5 << 20])
def test_streaming_real_block(size: int, step: int) -> None:
    data = os.urandom(size)
    s = StreamingCrc()
    for off, buf in chunks(data, [step]):
        s.update(off, buf)
    assert s.result(size) == crc(data)
    assert s.blocks(size) == ref_blocks(data, BLOCK)
    assert len(s.blocks(size) or b"") == 4 * block_count(size)


def test_streaming_empty_and_empty_writes() -> None:
    s = StreamingCrc(block=SMALL)
    assert s.result(0) == 0 and s.blocks(0) == b""
    s.update(0, b"")
    s.update(0, b"x" * SMALL)
    s.update(SMALL, b"")
    assert s.result(SMALL) == crc(b"x" * SMALL)
    assert s.blocks(SMALL) == ref_blocks(b"x" * SMALL, SMALL)


def test_update_accepts_bytearray_and_memoryview() -> None:
    data = os.urandom(3 * SMALL + 7)
    s = StreamingCrc(block=SMALL)
    s.update(0, bytearray(data[:100]))
    s.update(100, memoryview(data)[100:])
    assert s.result(len(data)) == crc(data)
    assert s.blocks(len(data)) == ref_blocks(data, SMALL)


@given(st.binary(max_size=800), st.binary(max_size=800),
       st.lists(st.integers(1, 150), min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_resume_with_blocks(first: bytes, more: bytes, sizes: list[int]) -> None:
    a = StreamingCrc(block=SMALL)
    for off, buf in chunks(first, sizes):
        a.update(off, buf)
    value, packed = a.result(len(first)), a.blocks(len(first))
    assert value is not None and packed is not None

    b = StreamingCrc(value, len(first), blocks=packed, block=SMALL)
    c = StreamingCrc(next_off=len(first), blocks=packed, block=SMALL)  # crc derived
    whole = first + more
    for s in (b, c):
        for off, buf in chunks(more, sizes):
            s.update(len(first) + off, buf)
        assert s.result(len(whole)) == crc(whole)
        assert s.blocks(len(whole)) == ref_blocks(whole, SMALL)


def test_resume_rejects_inconsistent_blocks() -> None:
    data = os.urandom(3 * SMALL + 1)
    packed = ref_blocks(data, SMALL)
    with pytest.raises(ValueError):
        StreamingCrc(crc(data) ^ 1, len(data), blocks=packed, block=SMALL)
    with pytest.raises(ValueError):
        StreamingCrc(crc(data), len(data) + SMALL, blocks=packed, block=SMALL)
    with pytest.raises(ValueError):
        StreamingCrc(crc(data), len(data), blocks=packed[:-1], block=SMALL)


def test_legacy_resume_without_blocks() -> None:
    # Old callers: StreamingCrc(value, next_off). The whole crc still extends; blocks unknown.
    first, more = os.urandom(5 * SMALL + 3), os.urandom(4 * SMALL + 9)
    s = StreamingCrc(crc(first), len(first), block=SMALL)
    assert s.result(len(first)) == crc(first) and s.blocks(len(first)) is None
    s.update(len(first), more[:10])
    s.update(len(first) + 10, more[10:])
    assert s.result(len(first + more)) == crc(first + more)
    assert s.blocks(len(first + more)) is None
    s.truncate(0)  # back to a fresh stream, blocks known again
    s.update(0, more)
    assert s.result(len(more)) == crc(more) and s.blocks(len(more)) == ref_blocks(more, SMALL)
    # Old default-block form, and the empty resume.
    assert StreamingCrc(crc(first), len(first)).result(len(first)) == crc(first)
    assert StreamingCrc(0, 0).blocks(0) == b""


def test_out_of_order_and_overwrite_invalidate() -> None:
    data = os.urandom(4 * SMALL)
    s = StreamingCrc(block=SMALL)
    s.update(0, data[:SMALL])
    s.update(2 * SMALL, data[2 * SMALL:])  # hole
    assert s.result(len(data)) is None and s.blocks(len(data)) is None
    s.update(SMALL, data[SMALL:2 * SMALL])  # stays invalid even if filled in later
    assert s.result(len(data)) is None and not s.valid

    s = StreamingCrc(block=SMALL)
    s.update(0, data)
    s.update(0, data[:1])  # overwrite
    assert s.result(len(data)) is None and s.blocks(len(data)) is None

    s = StreamingCrc(valid=False)
    s.update(0, data)
    assert s.result(len(data)) is None and s.blocks(len(data)) is None


def test_truncate() -> None:
    data = os.urandom(3 * SMALL + 5)
    s = StreamingCrc(block=SMALL)
    s.update(0, data)
    s.truncate(len(data))  # no-op
    assert s.result(len(data)) == crc(data)
    s.truncate(SMALL)  # shrinking invalidates
    assert s.result(SMALL) is None and s.blocks(SMALL) is None
    s.truncate(0)  # resets everything, even an invalid stream
    assert s.result(0) == 0 and s.blocks(0) == b""
    other = os.urandom(2 * SMALL + 1)
    s.update(0, other)
    assert s.result(len(other)) == crc(other)
    assert s.blocks(len(other)) == ref_blocks(other, SMALL)


# -- one pass over an fd ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, 3 * BLOCK + 7, 20 * BLOCK + 5])
def test_a_mapped_pass_gives_what_a_read_one_gives_holes_and_all(size: int) -> None:
    """The seal's mapped pass (blocks that are all data checksummed where they lie)
    against the reading one, on a tmpfs file with holes inside blocks, whole blocks
    of holes and data: the same crcs, also when the file is shorter than asked."""
    rng = random.Random(size)
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        data = bytearray(size)
        for _ in range(6 if size else 0):
            off = rng.randrange(size)
            piece = rng.randbytes(min(size - off, rng.choice([100, BLOCK // 3, 2 * BLOCK])))
            os.pwrite(fd, piece, off)
            data[off:off + len(piece)] = piece
        want = (crc(bytes(data)), ref_blocks(bytes(data), BLOCK))
        assert block_crcs_of_fd(fd, size) == want
        assert block_crcs_of_fd(fd, size, mapped=True) == want
        assert block_crcs_of_fd(fd, size + BLOCK, mapped=True) == want
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, SMALL, 10 * SMALL + 3, 40 * SMALL + 5, BLOCK,
                                  2 * BLOCK + 17])
def test_block_crcs_of_fd(tmp_path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert block_crcs_of_fd(fd, size) == (crc(data), ref_blocks(data, BLOCK))
        assert block_crcs_of_fd(fd, size, SMALL) == (crc(data), ref_blocks(data, SMALL))
        assert crc32c_of_fd(fd, size) == crc(data)
        # Shorter than claimed: checksummed as far as the file goes.
        assert block_crcs_of_fd(fd, size + 100, SMALL) == (crc(data), ref_blocks(data, SMALL))
    finally:
        os.close(fd)


# -- verify_range ----------------------------------------------------------------------------------


def test_verify_range_detects_flip() -> None:
    size = 7 * SMALL + 13
    data = os.urandom(size)
    packed = ref_blocks(data, SMALL)
    rng = random.Random(0)
    for first in range(block_count(size, SMALL)):
        for last in range(first, block_count(size, SMALL)):
            off, end = first * SMALL, min((last + 1) * SMALL, size)
            piece = data[off:end]
            assert verify_range(piece, off, packed, size, SMALL)
            bad = bytearray(piece)
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
            assert not verify_range(bytes(bad), off, packed, size, SMALL)
    assert verify_range(b"", SMALL, packed, size, SMALL)  # nothing covered


def test_verify_range_real_block() -> None:
    data = os.urandom(BLOCK + 100)
    packed = ref_blocks(data, BLOCK)
    assert verify_range(data, 0, packed, len(data))
    assert verify_range(data[BLOCK:], BLOCK, packed, len(data))
    bad = bytearray(data)
    bad[BLOCK + 50] ^= 0x80
    assert not verify_range(bytes(bad), 0, packed, len(data))
    assert verify_range(bytes(bad[:BLOCK]), 0, packed, len(data))  # flip outside the range


def test_verify_range_rejects_misuse() -> None:
    size = 3 * SMALL + 1
    data = os.urandom(size)
    packed = ref_blocks(data, SMALL)
    with pytest.raises(ValueError):
        verify_range(data[1:SMALL], 1, packed, size, SMALL)  # unaligned start
    with pytest.raises(ValueError):
        verify_range(data[:SMALL + 1], 0, packed, size, SMALL)  # partial block mid-file
    with pytest.raises(ValueError):
        verify_range(data + b"x", 0, packed, size, SMALL)  # past the end
    with pytest.raises(ValueError):
        verify_range(data, 0, packed[:-4], size, SMALL)  # wrong number of crcs


def test_helpers() -> None:
    assert [block_count(n, SMALL) for n in (0, 1, SMALL, SMALL + 1)] == [0, 1, 1, 2]
    assert block_count(BLOCK) == 1 and BLOCK == 4 << 20
    assert unpack_crcs(pack_crcs([1, 0xFFFFFFFF])) == [1, 0xFFFFFFFF]
    assert pack_crcs([0x01020304]) == b"\x04\x03\x02\x01"  # little-endian
    assert format_crc(0xAB) == "000000ab" and format_crc(None) is None


# -- throughput (reported, not asserted) -----------------------------------------------------------


def test_throughput_report() -> None:
    buf = os.urandom(1 << 20)
    n = 1024  # 1 GiB in 1 MiB writes

    def plain() -> float:
        t, c = time.perf_counter(), 0
        for _ in range(n):
            c = google_crc32c.extend(c, buf)
        return time.perf_counter() - t

    def streaming(first: int) -> float:
        # first != 0 shifts every write off the block grid, so one buf in four is split.
        s = StreamingCrc()
        t = time.perf_counter()
        s.update(0, buf[:first])
        for i in range(n):
            s.update(first + i * len(buf), buf)
        s.result(first + n * len(buf))
        return time.perf_counter() - t

    base = min(plain() for _ in range(3))
    aligned = min(streaming(0) for _ in range(3))
    unaligned = min(streaming(4096) for _ in range(3))
    gib = n * len(buf) / (1 << 30)
    print(f"\n1 GiB in 1 MiB bufs: google_crc32c.extend {gib / base:.2f} GiB/s, "
          f"StreamingCrc aligned {gib / aligned:.2f} GiB/s ({aligned / base - 1:+.1%}), "
          f"unaligned {gib / unaligned:.2f} GiB/s ({unaligned / base - 1:+.1%})")


def test_chunk_crcs_derive_from_block_crcs(tmp_path):
    """An object's chunk crcs (durable tier) follow from the file's block crcs (RAM tier,
    peers) without reading the data again: one scheme."""
    from mtcfs.core.checksums import chunk_crcs_from_blocks, chunk_crcs_of_fd

    for size in (0, 1, BLOCK - 1, BLOCK, 16 * BLOCK + 5, 300 * BLOCK + 17):
        p = tmp_path / f"f{size}"
        with open(p, "wb") as f:
            f.truncate(size)
            if size:
                f.seek(random.Random(size).randrange(size))
                f.write(b"x" * min(5000, size))
            f.truncate(size)
        fd = os.open(p, os.O_RDONLY)
        try:
            _, blocks = block_crcs_of_fd(fd, size)
            assert chunk_crcs_from_blocks(blocks, size) == chunk_crcs_of_fd(fd, size), size
        finally:
            os.close(fd)
