"""The striped restore's queue (mtcfs.peer.striped): file order, unless a reader
waits elsewhere; then the stripe it waits in, from its block, and on from there."""

from __future__ import annotations

import pytest
import trio

from mtcfs.peer.striped import Progress, Striped

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]


async def order_of(blocks: int, focus: int | None, holders: int = 1) -> list[int]:
    taken: list[int] = []

    def fetch(h: str, first: int, last: int, progress: Progress) -> None:
        taken.append(first)
        progress.next = last

    s = Striped(fetch, blocks, 1, trio.CapacityLimiter(1), stripe=4, focus=lambda: focus)
    by = await s.run([f"h{i}" for i in range(holders)])
    assert sum(by.values()) == 0 and not s.errors  # (this fetch counts no bytes)
    return taken


async def test_file_order_without_a_waiting_reader():
    assert await order_of(24, None) == [0, 4, 8, 12, 16, 20]


async def test_a_reader_waiting_far_in_is_served_next_then_on_from_there():
    # A reader waits at block 13 (in stripe 12-15): that stripe from block 13 first,
    # the ones after it, then what lay before (block 12 last: cut off its stripe).
    assert await order_of(24, 13) == [13, 16, 20, 0, 4, 8, 12]
    assert await order_of(24, 16) == [16, 20, 0, 4, 8, 12]  # a stripe's first block


async def test_a_reader_at_the_head_changes_nothing():
    assert await order_of(12, 0) == [0, 4, 8]


async def test_a_reader_inside_the_head_stripe_gets_its_block_first():
    assert await order_of(12, 3) == [3, 4, 8, 0]
