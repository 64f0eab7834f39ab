"""The seal pipeline (mtcfs.fs.sealer.Sealer), in-process: when close, fsync,
truncate and release seal a file, and what the seal records when writes, opens and
truncates race with it. Every test checks the sealed checksums against the RAM
file's bytes, computed afresh.

Passthrough is played here as the kernel plays it: a handle opened with a backing
file gets its writes straight into the RAM file (os.pwrite on its fd), unseen by
the daemon."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import google_crc32c
import pytest
import trio

from mtcfs.core.checksums import BLOCK, block_crcs_of_fd
from mtcfs.core.namespace import CLOSED, OPEN, SEALING, Inode
from mtcfs.fs.filesystem import FsError
from mtcfs.tiers.ram import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE

from support.inprocess import Host
from support.onemount import crash, mount_at, pt_write

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


def crc(data: bytes) -> int:
    return google_crc32c.value(data)


def on_ram(h: Host, path: str) -> tuple[int, bytes | None]:
    """The checksums of the file's RAM copy as it is now."""
    node = h.node(path)
    fd = h.mount.ram.open_read(node.ino)
    try:
        return block_crcs_of_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def sealed_right(h: Host, path: str) -> bool:
    node = h.node(path)
    return node.state == CLOSED and (node.crc32c, node.block_crcs) == on_ram(h, path)


async def start_in_pass(n: trio.Nursery, h: Host, node: Inode, fn, *args) -> None:  # type: ignore[no-untyped-def]
    """Start `fn(*args)` in `n` and return once its seal's checksum pass is in flight."""
    n.start_soon(fn, *args)
    while not h.fs.sealer.in_pass(node):
        await trio.sleep(0)


@pytest.fixture
async def pt(tmp_path: Path) -> AsyncIterator[Host]:
    """A mount whose kernel agreed to passthrough: writers with room get a backing file."""
    m = mount_at(tmp_path, passthrough=True)
    yield Host(m)
    crash(m)


async def pt_file(h: Host, path: str, data: bytes) -> int:
    """A new file written through passthrough (its create answered with a backing
    file); its open handle."""
    fh = await h.open(path, os.O_WRONLY | os.O_CREAT)
    pt_write(h, fh, 0, data)
    return fh


# -- close, release: passthrough ---------------------------------------------------------


async def test_a_passthrough_close_leaves_it_sealing_and_the_release_seals_it(pt) -> None:
    h: Host = pt
    fh = await pt_file(h, "f", b"through the kernel")
    await h.fs.flush(fh)
    assert h.node("f").state == SEALING  # close() returned without a pass
    await h.fs.release(fh)
    assert sealed_right(h, "f") and h.node("f").crc32c == crc(b"through the kernel")
    assert h.node("f").version == 1


async def test_a_write_after_close_before_the_release_is_in_the_seal(pt) -> None:
    """A shared writable mapping may write after close(): the release's seal has it."""
    h: Host = pt
    fh = await pt_file(h, "f", b"before close")
    await h.fs.flush(fh)
    pt_write(h, fh, 12, b", after close")
    await h.fs.release(fh)
    assert h.node("f").crc32c == crc(b"before close, after close") and sealed_right(h, "f")
    assert h.state("f")["size"] == len(b"before close, after close")


async def test_a_second_writer_during_sealing_seals_the_first_version_first(pt) -> None:
    h: Host = pt
    fh1 = await pt_file(h, "f", b"one")
    await h.fs.flush(fh1)
    assert h.node("f").state == SEALING
    fh2 = await h.fs.open(h.node("f"), os.O_WRONLY)  # before fh1's release
    node = h.node("f")
    assert node.state == CLOSED and node.crc32c == crc(b"one")
    first = node.version
    pt_write(h, fh2, 0, b"two")
    await h.fs.release(fh1)
    await h.close(fh2)
    assert node.crc32c == crc(b"two") and node.version == first + 1 and sealed_right(h, "f")


async def test_fsync_then_close_without_a_write_keeps_the_fsyncs_seal(pt) -> None:
    h: Host = pt
    fh = await pt_file(h, "f", b"fsynced")
    await h.fs.fsync(fh)
    node = h.node("f")
    assert node.state == CLOSED and node.crc32c == crc(b"fsynced")
    version, seals = node.version, h.fs.sealer.stats.seals
    await h.fs.flush(fh)
    assert h.fs.sealer.stats.seals == seals  # unchanged since: no seal at close
    await h.fs.release(fh)  # the release checksums it once more: the same version
    assert node.version == version and sealed_right(h, "f")


async def test_a_write_between_fsync_and_close_is_sealed_at_close(pt) -> None:
    """Fsynced files are visible at close: sealed then, not left to the release."""
    h: Host = pt
    fh = await pt_file(h, "f", b"first")
    await h.fs.fsync(fh)
    version = h.node("f").version
    pt_write(h, fh, 5, b" and more")
    await h.fs.flush(fh)
    node = h.node("f")
    assert node.state == CLOSED and node.crc32c == crc(b"first and more")
    assert node.version == version + 1
    await h.fs.release(fh)
    assert node.version == version + 1 and sealed_right(h, "f")


async def test_fsync_seals_a_reopened_file_written_through_passthrough(pt) -> None:
    h: Host = pt
    await h.write_file("f", b"old")
    fh = await h.fs.open(h.node("f"), os.O_WRONLY)
    pt_write(h, fh, 0, b"new")
    await h.fs.fsync(fh)
    try:
        assert h.node("f").crc32c == crc(b"new")
    finally:
        await h.close(fh)


async def test_a_passthrough_writer_records_the_file_open(pt) -> None:
    """While a writer the daemon cannot see is open, the record says open: a crash
    leaves it incomplete unless its data is still the sealed version."""
    h: Host = pt
    await h.write_file("f", b"sealed")
    fh = await h.fs.open(h.node("f"), os.O_RDWR)
    node = h.node("f")
    assert node.state == CLOSED and node.row().state == OPEN
    await h.close(fh)
    assert node.row().state == CLOSED


async def test_passthrough_bytes_are_counted_at_a_new_version(pt) -> None:
    h: Host = pt
    fh = await pt_file(h, "f", b"x" * 1000)
    await h.close(fh)
    assert h.fs.sealer.stats.bytes_written_passthrough == 1000
    fh = await h.fs.open(h.node("f"), os.O_RDWR)  # opened, nothing written
    await h.close(fh)
    assert h.fs.sealer.stats.bytes_written_passthrough == 1000


async def test_a_directory_fsync_leaves_a_held_file_to_its_release(pt) -> None:
    """A directory fsync seals what is `sealing` under it unless a writer still holds
    it (its mapping may still write): that one is sealed by its release."""
    h: Host = pt
    h.makedirs("step_1")
    fh = await pt_file(h, "step_1/shard", b"shard bytes")
    await h.fs.flush(fh)
    await h.fs.release(fh)
    fh = await pt_file(h, "step_1/other", b"other bytes")
    await h.fs.flush(fh)
    assert h.node("step_1/other").state == SEALING
    await h.fs.names.fsyncdir(h.node("step_1"))
    assert h.node("step_1/other").state == SEALING
    await h.fs.release(fh)
    assert sealed_right(h, "step_1/other") and sealed_right(h, "step_1/shard")


# -- close, fsync, truncate: through the daemon ------------------------------------------


async def test_fsync_seals_what_was_written_so_far(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"part one")
    await h.fs.fsync(fh)
    node = h.node("f")
    assert node.state == CLOSED and node.crc32c == crc(b"part one") and node.version == 1
    await h.write(fh, 8, b", part two")
    assert node.state == OPEN and node.dirty
    await h.close(fh)
    assert node.crc32c == crc(b"part one, part two") and node.version == 2
    assert sealed_right(h, "f")


async def test_fsync_of_an_unchanged_file_seals_nothing(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"data")
    seals = h.fs.sealer.stats.seals
    fh = await h.open("f", os.O_RDWR)
    await h.fs.fsync(fh)
    assert h.fs.sealer.stats.seals == seals and h.node("f").version == 1
    await h.close(fh)
    assert h.node("f").version == 1


async def test_only_the_last_writers_close_seals(make_host) -> None:
    h: Host = await make_host()
    fh1 = await h.open("f", os.O_WRONLY | os.O_CREAT)
    fh2 = await h.open("f", os.O_WRONLY)
    await h.write(fh1, 0, b"aaaa")
    await h.close(fh1)
    assert h.node("f").state == OPEN  # fh2 still writes
    await h.write(fh2, 4, b"bbbb")
    await h.close(fh2)
    assert h.node("f").crc32c == crc(b"aaaabbbb") and sealed_right(h, "f")


async def test_truncate_of_a_closed_file_seals_it_again(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"0123456789")
    await h.fs.setattr(h.node("f"), size=4)
    node = h.node("f")
    assert node.state == CLOSED and node.version == 2 and node.crc32c == crc(b"0123")
    assert sealed_right(h, "f")


async def test_extending_truncate_seals_zeros(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"abc")
    await h.fs.setattr(h.node("f"), size=BLOCK + 5)
    assert h.node("f").crc32c == crc(b"abc" + bytes(BLOCK + 2)) and sealed_right(h, "f")


async def test_truncate_while_written_is_sealed_by_the_close(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"written then cut")
    await h.fs.setattr(h.node("f"), size=7)
    assert h.node("f").state == OPEN  # the writer still has it: sealed at its close
    await h.close(fh)
    assert h.node("f").crc32c == crc(b"written") and sealed_right(h, "f")


async def test_an_o_trunc_open_closed_at_once_seals_an_empty_version(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"old content")
    fh = await h.open("f", os.O_WRONLY | os.O_TRUNC)
    await h.close(fh)
    node = h.node("f")
    assert node.size == 0 and node.crc32c == crc(b"") and node.version == 2


async def test_a_write_during_the_pass_is_sealed_by_the_release(make_host) -> None:
    """The close's seal takes a pass (written out of order); a write lands during it:
    that seal gives up (the writer is still there) and the release seals again."""
    h: Host = await make_host()
    data = os.urandom(2 * BLOCK)
    fh = await h.open("f", os.O_RDWR | os.O_CREAT)
    await h.write(fh, BLOCK, data[BLOCK:])
    await h.write(fh, 0, data[:BLOCK])
    node = h.node("f")
    async with trio.open_nursery() as n:
        await start_in_pass(n, h, node, h.fs.flush, fh)
        await h.write(fh, 0, b"late")  # during the pass
    assert node.dirty and node.state == OPEN  # that seal did not stand
    await h.fs.release(fh)
    assert node.crc32c == crc(b"late" + data[4:]) and sealed_right(h, "f")


async def test_a_passthrough_write_during_the_fsync_pass_leaves_it_to_the_release(pt) -> None:
    """A reopened file written through passthrough is fsynced; the writer (which the
    daemon does not see) appends during the seal's pass: that seal does not stand (the
    RAM file's size and ctime moved), and the release seals what is there."""
    h: Host = pt
    await h.write_file("f", b"old")
    fh = await h.fs.open(h.node("f"), os.O_RDWR)
    data = os.urandom(3 * BLOCK)
    pt_write(h, fh, 0, data)
    node = h.node("f")
    version = node.version
    async with trio.open_nursery() as n:
        await start_in_pass(n, h, node, h.fs.fsync, fh)
        pt_write(h, fh, len(data), b"tail")
    assert node.version == version and not node.fsynced  # that seal did not stand
    await h.close(fh)
    assert node.crc32c == crc(data + b"tail") and sealed_right(h, "f")
    assert node.version == version + 1


async def test_a_truncate_during_the_pass_with_no_writer_is_sealed_again(pt) -> None:
    """The release's seal (no writer left) takes its pass; a truncate lands during it.
    No release will come to seal that, so the seal takes the file again."""
    h: Host = pt
    data = os.urandom(3 * BLOCK)
    fh = await pt_file(h, "f", data)
    await h.fs.flush(fh)
    node = h.node("f")
    async with trio.open_nursery() as n:
        await start_in_pass(n, h, node, h.fs.release, fh)
        await h.fs.setattr(node, size=10)
    assert node.size == 10 and not node.dirty and sealed_right(h, "f")
    assert node.crc32c == crc(data[:10])


class PassLog(list):
    """The seal's checksum passes, as ("pass", mapped) and ("pass over", mapped), and
    whatever a test adds; each pass takes `delay` seconds more."""

    delay = 0.0


@pytest.fixture
def passes(pt, monkeypatch) -> PassLog:
    """`pt` with huge pages (its seals' passes read through a mapping), each pass
    logged."""
    import mtcfs.fs.sealer as sealer_module

    pt.mount.ram.huge_pages.in_use = True
    log = PassLog()
    real_pass = sealer_module.block_crcs_of_fd

    def logged_pass(fd: int, size: int, mapped: bool = False) -> tuple[int, bytes]:
        log.append(("pass", mapped))
        got = real_pass(fd, size, mapped=mapped)
        time.sleep(log.delay)
        log.append(("pass over", mapped))
        return got

    monkeypatch.setattr(sealer_module, "block_crcs_of_fd", logged_pass)
    return log


@pytest.mark.parametrize("how", ["truncate", "open O_TRUNC", "punch"])
async def test_a_shrink_waits_for_a_mapped_pass(pt, passes: PassLog, monkeypatch,
                                                how: str) -> None:
    """With huge pages the seal's pass reads the RAM file through a mapping, where a
    page past the end is SIGBUS and a hole touched is a page allocated: a truncate,
    an O_TRUNC open and a punched hole wait until the pass is over (the pass is made
    slow here)."""
    h: Host = pt
    log = passes
    log.delay = 0.3
    ram = h.mount.ram
    for name in ("truncate", "fallocate"):
        real = getattr(ram, name)

        def spy(*args, real=real, name=name, **kw):  # type: ignore[no-untyped-def]
            log.append((name, False))
            return real(*args, **kw)

        monkeypatch.setattr(ram, name, spy)
    data = os.urandom(3 * BLOCK)
    fh = await pt_file(h, "f", data)
    node = h.node("f")
    async with trio.open_nursery() as n:
        # An fsync's pass, the writer still there: nothing else seals before the shrink.
        await start_in_pass(n, h, node, h.fs.fsync, fh)
        if how == "truncate":
            await h.fs.setattr(node, size=10)
        elif how == "open O_TRUNC":
            await h.close(await h.fs.open(node, os.O_WRONLY | os.O_TRUNC))
        else:
            await h.fs.fallocate(fh, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, BLOCK)
    await h.close(fh)
    shrink = "fallocate" if how == "punch" else "truncate"
    at = [k for k, (what, _) in enumerate(log) if what == shrink][0]
    before = [what for what, _ in log[:at]]
    assert log[0] == ("pass", True) and before.count("pass") == before.count("pass over")
    want = {"truncate": data[:10], "open O_TRUNC": b"",
            "punch": bytes(BLOCK) + data[BLOCK:]}[how]
    assert node.crc32c == crc(want) and sealed_right(h, "f")


async def test_a_pass_that_starts_during_a_shrink_reads(pt, passes: PassLog) -> None:
    h: Host = pt
    fh = await pt_file(h, "f", os.urandom(BLOCK + 1))
    node = h.node("f")
    async with h.fs.sealer.shrinking(node):
        await h.fs.fsync(fh)
    pt_write(h, fh, 0, b"again")
    await h.fs.fsync(fh)
    await h.close(fh)
    seen = [mapped for what, mapped in passes if what == "pass"]
    assert seen[:2] == [False, True] and sealed_right(h, "f")


async def test_a_punched_hole_is_zeros_in_the_seal(make_host) -> None:
    h: Host = await make_host()
    data = os.urandom(2 * BLOCK)
    fh = await h.open("f", os.O_RDWR | os.O_CREAT)
    await h.write(fh, 0, data)
    passes = h.fs.sealer.stats.seal_full_passes
    await h.fs.fallocate(fh, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 100, 4096)
    await h.close(fh)
    want = data[:100] + bytes(4096) + data[4196:]
    assert h.node("f").crc32c == crc(want) and sealed_right(h, "f")
    assert h.fs.sealer.stats.seal_full_passes == passes + 1  # streamed bytes were zeroed


async def test_allocating_past_the_end_keeps_the_version(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"data")
    fh = await h.open("f", os.O_RDWR)
    await h.fs.fallocate(fh, FALLOC_FL_KEEP_SIZE, 0, 1 << 20)
    await h.close(fh)
    node = h.node("f")
    assert node.version == 1 and node.size == 4 and node.crc32c == crc(b"data")


async def test_the_first_write_records_the_file_open(make_host) -> None:
    """A crash from the first write on leaves the file incomplete, never silently
    changed: its record says open before close."""
    h: Host = await make_host()
    await h.write_file("f", b"sealed")
    fh = await h.open("f", os.O_WRONLY)
    assert {r.ino: r.state for r in h.ns.store.load_inodes()}[h.node("f").ino] == CLOSED
    await h.write(fh, 0, b"S")
    assert {r.ino: r.state for r in h.ns.store.load_inodes()}[h.node("f").ino] == OPEN
    await h.close(fh)
    assert {r.ino: r.state for r in h.ns.store.load_inodes()}[h.node("f").ino] == CLOSED


async def test_an_unlinked_open_file_is_never_sealed(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"doomed")
    node = h.node("f")
    h.unlink("f")
    seals = h.fs.sealer.stats.seals
    await h.close(fh)
    assert h.fs.sealer.stats.seals == seals and not node.dirty and node.version == 0
    with pytest.raises(FsError) as e:
        h.node("f")
    assert e.value.errno == errno.ENOENT


async def test_a_regular_file_made_by_mknod_is_sealed_empty(make_host) -> None:
    h: Host = await make_host()
    node = h.fs.names.mknod(h.node("").ino, b"reg", stat.S_IFREG | 0o644, 0, 0, 0)
    assert node.state == CLOSED and node.version == 1 and node.crc32c == crc(b"")
    assert await h.read_file("reg") == b""


async def test_in_order_writes_by_two_handles_stream_without_a_pass(make_host) -> None:
    h: Host = await make_host()
    fh = await h.open("f", os.O_WRONLY | os.O_CREAT)
    await h.write(fh, 0, b"a" * 100)
    reader_fh = await h.open("f", os.O_RDONLY)
    await h.close(reader_fh)  # a reader's release keeps the writer's stream
    await h.write(fh, 100, b"b" * 100)
    await h.close(fh)
    assert h.fs.sealer.stats.seal_full_passes == 0 and sealed_right(h, "f")
