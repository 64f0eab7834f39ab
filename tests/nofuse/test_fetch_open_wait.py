"""How long a reader's open of a file that is not here waits for it whole
(mtcfs.fetch.Fetcher.open_wait): a prefetch or a replacement's restore is waited
for; a file a step's read-ahead brings, only when it is due within STEP_OPEN_WAIT
(a slice of a large shard is read as it arrives instead)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from mtcfs.fetch import ASSUMED_RATE, RATE_BYTES, STEP_OPEN_WAIT, Fetch

pytestmark = [pytest.mark.nofuse, pytest.mark.trio]

MiB = 1 << 20


async def test_a_fetch_is_due_at_its_own_rate_once_it_has_moved_enough():
    now = time.monotonic()
    f = Fetch(64 * MiB, started=now - 0.1)
    assert f.eta(ASSUMED_RATE, now) == pytest.approx(64 * MiB / ASSUMED_RATE)
    f.add(0, RATE_BYTES // 2)  # too little to tell its rate: the assumed one
    assert f.eta(ASSUMED_RATE, now) == pytest.approx((64 * MiB - RATE_BYTES // 2)
                                                     / ASSUMED_RATE)
    f.add(RATE_BYTES // 2, 48 * MiB - RATE_BYTES // 2)  # 48 MiB in 0.1 s: 480 MiB/s
    assert f.eta(ASSUMED_RATE, now) == pytest.approx(16 / 480)
    f.add(48 * MiB, 16 * MiB)
    assert f.eta(ASSUMED_RATE, now) == 0


async def test_an_open_waits_for_what_is_read_ahead_and_due_soon(make_host):
    fetcher = (await make_host("a")).mount.fetcher
    node = SimpleNamespace(ino=10_001, size=64 * MiB)
    assert fetcher.open_wait(node) is None  # fetched for nobody: read as it arrives

    fetcher._stepping.add(node.ino)  # a step's read-ahead brings it (not started yet)
    fetcher.rate = 1 << 30
    assert fetcher.open_wait(node) == pytest.approx(4 * (64 / 1024) + 0.1)
    fetcher.rate = 64 * MiB / (2 * STEP_OPEN_WAIT)  # due in twice the bound
    assert fetcher.open_wait(node) is None

    # Under way, 48 of 64 MiB here after 0.1 s: due in 1/30 s whatever the last rate.
    f = fetcher.fetches[node.ino] = Fetch(node.size, started=time.monotonic() - 0.1)
    f.add(0, 48 * MiB)
    assert fetcher.open_wait(node) == pytest.approx(4 * (16 / 480) + 0.1, rel=0.05)
    f.fail("a holder went away")  # a failed fetch tells nothing: the last rate again
    assert fetcher.open_wait(node) is None

    fetcher._stepping.discard(node.ino)
    fetcher._ahead.add(node.ino)  # a prefetch: waited for while under way
    fetcher.fetches[node.ino] = Fetch(node.size)
    assert fetcher.open_wait(node) == math.inf
    del fetcher.fetches[node.ino]
