"""Files read through a mapping (mtcfs.tiers.mapped), in-process: a transfer on the
data channel holds a pin on the RAM file it sends from, and the file system neither
shrinks that file nor punches a hole in it until the pin is released (a mapped page
past the end is SIGBUS: the daemon would die); a pin asked for during a shrink is
refused, and the transfer reads instead. Then the channel's two ends over a real
socket pair, the sender sending from a mapping: bytes exact, a range with a hole read."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import pytest
import trio

from mtcfs.core.checksums import BLOCK, unmap
from mtcfs.peer import bulk
from mtcfs.peer.bulk import Keys
from mtcfs.tiers.mapped import MappedFiles, map_range
from mtcfs.tiers.ram import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE

from support.inprocess import Host

pytestmark = [pytest.mark.nofuse]

TOKEN = b"a-token-of-thirty-two-bytes-or-more-0123"


@pytest.mark.trio
@pytest.mark.parametrize("how", ["truncate", "open O_TRUNC", "punch"])
async def test_a_shrink_waits_for_a_transfer_that_maps_the_file(make_host, how: str) -> None:
    h: Host = await make_host()
    ram = h.mount.ram
    ram.huge_pages.in_use = True  # (what makes mappings worth it: huge pages)
    data = os.urandom(2 * BLOCK)
    await h.write_file("f", data)
    node = h.node("f")
    pin = ram.mapped.pin(node.ino)  # a transfer sends it from a mapping
    assert pin.mapped
    done = trio.Event()

    async def shrink() -> None:
        if how == "truncate":
            await h.fs.setattr(node, size=10)
        elif how == "open O_TRUNC":
            await h.close(await h.fs.open(node, os.O_WRONLY | os.O_TRUNC))
        else:
            fh = await h.fs.open(node, os.O_RDWR)
            await h.fs.fallocate(fh, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, BLOCK)
            await h.close(fh)
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(shrink)
        await trio.sleep(0.2)
        assert not done.is_set()  # waiting for the transfer
        assert Path(ram.path(node.ino)).read_bytes() == data
        assert not ram.mapped.pin(node.ino).mapped  # none new meanwhile
        await trio.to_thread.run_sync(pin.release)  # (released in a worker, as transfers do)
    want = {"truncate": data[:10], "open O_TRUNC": b"",
            "punch": bytes(BLOCK) + data[BLOCK:]}[how]
    assert Path(ram.path(node.ino)).read_bytes() == want
    assert node.crc32c == google_crc32c.value(want)
    again = ram.mapped.pin(node.ino)
    assert again.mapped  # the shrink is over
    again.release()
    again.release()  # (a second release changes nothing)
    assert not ram.mapped.in_use(node.ino)


@pytest.mark.trio
async def test_nothing_is_mapped_without_huge_pages(make_host) -> None:
    h: Host = await make_host()
    await h.write_file("f", b"x" * 100)
    assert not h.mount.ram.huge_pages.in_use
    assert not h.mount.ram.mapped.pin(h.node("f").ino).mapped


def test_map_range_refuses_a_hole_and_a_short_file(tmp_path: Path) -> None:
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"a" * BLOCK, 0)
        os.ftruncate(fd, 3 * BLOCK)  # a hole after the first block
        view = map_range(fd, 0, BLOCK)
        assert view is not None and bytes(view[:4]) == b"aaaa"
        unmap(view)
        assert map_range(fd, 0, 2 * BLOCK) is None  # a hole in it
        assert map_range(fd, 0, 4 * BLOCK) is None  # past the end
    finally:
        os.close(fd)


def session_pair(encrypt: bool) -> tuple[bulk.Conn, bulk.Conn, socket.socket]:
    a, b = socket.socketpair()
    keys = Keys(TOKEN, encrypt).session(b"s" * 32, b"c" * 32)
    return (bulk.Conn(a, keys, client=True, encrypt=encrypt),
            bulk.Conn(b, keys, client=False, encrypt=encrypt), a)


@pytest.mark.parametrize("encrypt", [False, True], ids=["gmac", "encrypted"])
@pytest.mark.parametrize("sender_hole", [False, True], ids=["all data", "a hole"])
def test_blocks_are_sent_from_a_mapping(tmp_path: Path, encrypt: bool, sender_hole: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender mapped: the bytes arrive exact, each block's crc32c is right, and a
    range with a hole in it is read instead (touching a hole through a mapping would
    allocate a page)."""
    sender, receiver, _ = session_pair(encrypt)
    data = bytearray(os.urandom(3 * BLOCK - 777))
    src = tmp_path / "src"
    fd = os.open(src, os.O_RDWR | os.O_CREAT, 0o600)
    if sender_hole:  # the middle block never written: a hole
        data[BLOCK:2 * BLOCK] = bytes(BLOCK)
        os.pwrite(fd, data[:BLOCK], 0)
        os.pwrite(fd, data[2 * BLOCK:], 2 * BLOCK)
    else:
        os.pwrite(fd, data, 0)
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    spans = bulk.spans(0, len(data))
    sent: list[int] = []
    mapped: list[bool] = []

    def spy(*args: int) -> memoryview | None:
        view = map_range(*args)
        mapped.append(view is not None)
        return view

    monkeypatch.setattr(bulk, "map_range", spy)

    def send() -> None:
        with ThreadPoolExecutor(2) as ahead:
            sent.extend(sender.send_blocks(fd, 0, len(data), ahead=ahead, mapped=True))

    t = threading.Thread(target=send)
    t.start()
    try:
        with ThreadPoolExecutor(2) as verifier:
            got = list(receiver.land_blocks(out, spans, verifier))
    finally:
        t.join(10)
        os.close(fd)
        os.close(out)
        sender.close()
        receiver.close()
    assert sum(sent) == len(data)
    assert mapped == [not sender_hole]  # sent from the mapping, or read (a hole)
    assert [(off, n) for off, n, _ in got] == spans
    for off, n, crc in got:
        assert crc == google_crc32c.value(bytes(data[off:off + n]))
    assert (tmp_path / "out").read_bytes() == data


def test_mapped_files_without_huge_pages_pins_nothing() -> None:
    off = MappedFiles(lambda: False)
    assert not off.pin(1).mapped and not off.in_use(1)
