"""The seal and checksum rules, in-process: a closed file's version, crc32c and
per-block crc32cs; what a rewrite, an unchanged write-open and a crash leave."""

from __future__ import annotations

import errno
import os

import google_crc32c
import pytest

from mtcfs.core.checksums import BLOCK, block_crcs_of_fd
from mtcfs.fs.filesystem import FsError

from support.inprocess import Host

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def crc(data: bytes) -> int:
    return google_crc32c.value(data)


def ram_blocks(h: Host, path: str) -> tuple[int, bytes | None]:
    """The checksums of the file's RAM copy, computed afresh."""
    node = h.node(path)
    fd = h.mount.ram.open_read(node.ino)
    try:
        return block_crcs_of_fd(fd, node.size)
    finally:
        os.close(fd)


async def test_sequential_writes_seal_without_a_pass(make_host) -> None:
    h: Host = await make_host()
    data = os.urandom(3 * BLOCK + 12345)
    node = await h.write_file("f", data)
    st = h.state("f")
    assert st["state"] == "closed" and st["version"] == 1
    assert node.crc32c == crc(data) and st["crc32c"] == f"{crc(data):08x}"
    assert (node.crc32c, node.block_crcs) == ram_blocks(h, "f")
    assert h.fs.sealer.stats.seal_full_passes == 0  # streamed as written


async def test_out_of_order_writes_take_one_pass(make_host) -> None:
    h: Host = await make_host()
    data = os.urandom(2 * BLOCK + 100)
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, BLOCK, data[BLOCK:])
    await h.write(fh, 0, data[:BLOCK])
    await h.close(fh)
    node = h.node("f")
    assert node.crc32c == crc(data) and (node.crc32c, node.block_crcs) == ram_blocks(h, "f")
    assert h.fs.sealer.stats.seal_full_passes == 1


async def test_holes_are_zeros_in_the_checksum(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("sparse", os.O_WRONLY | os.O_CREAT)
    await h.fs.setattr(h.node("sparse"), size=5 * BLOCK)
    await h.write(fh, 4 * BLOCK + 7, b"end")
    await h.close(fh)
    want = bytearray(5 * BLOCK)
    want[4 * BLOCK + 7:4 * BLOCK + 10] = b"end"
    assert h.node("sparse").crc32c == crc(bytes(want))
    assert await h.read_file("sparse") == bytes(want)


async def test_versions(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"one")
    assert h.state("f")["version"] == 1
    # Opened for writing, nothing written: the same version (its copies stay good).
    fh = await h.open("f", os.O_RDWR)
    assert await h.fs.read(fh, 0, 3) == b"one"
    await h.close(fh)
    assert h.state("f")["version"] == 1 and h.state("f")["crc32c"] == f"{crc(b'one'):08x}"
    # Rewritten: a new version with its own checksum.
    await h.write_file("f", b"two!")
    st = h.state("f")
    assert st["version"] == 2 and st["crc32c"] == f"{crc(b'two!'):08x}" and st["size"] == 4
    # fsync seals what was written so far, as a version others may read.
    fh = await h.open("f", os.O_WRONLY | os.O_APPEND)
    await h.write(fh, 0, b"+3")
    await h.fs.fsync(fh)
    assert h.state("f")["version"] == 3 and h.node("f").crc32c == crc(b"two!+3")
    await h.write(fh, 0, b"+4")
    assert h.state("f")["state"] == "open"
    await h.close(fh)
    assert h.state("f")["version"] == 4 and h.node("f").crc32c == crc(b"two!+3+4")


async def test_a_crash_leaves_changed_files_incomplete(make_host) -> None:
    h: Host = await make_host("a")
    await h.write_file("kept", b"sealed before the crash")
    await h.write_file("changed", b"old")
    await h.write_file("reopened", b"same")
    fh1 = await h.open("changed", os.O_WRONLY)
    await h.write(fh1, 0, b"NEW")  # written, never closed
    fh2 = await h.open("reopened", os.O_RDWR)  # opened for writing, never written
    await h.fs.fsync(fh2)
    fh3 = await h.open("new", os.O_WRONLY | os.O_CREAT)
    await h.write(fh3, 0, b"half a file")
    h.mount.stop()  # the daemon dies: nothing is released
    h.mount.close()

    h2: Host = await make_host("a")  # the same RAM dir: recovery
    assert await h2.read_file("kept") == b"sealed before the crash"
    assert h2.state("reopened")["state"] == "closed"
    assert await h2.read_file("reopened") == b"same"
    for path in ("changed", "new"):
        assert h2.state(path)["state"] == "incomplete"
        with pytest.raises(FsError) as e:
            await h2.read_file(path)
        assert e.value.errno == errno.EIO  # never presented as a good file
    # An incomplete file is truncated to 0 or rewritten, or removed.
    await h2.write_file("changed", b"rewritten")
    assert h2.state("changed")["state"] == "closed"
    h2.unlink("new")
