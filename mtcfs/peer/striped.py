"""Striped restores: a file's blocks from all its live holders at once.

The file's blocks are cut into stripes (runs of a few blocks) in one queue, in
file order, so readers waiting at the start are served first; a reader that
waits elsewhere (a ranged read of a large file: a resharded load reads slices)
moves the queue's head there: the stripe it waits for is taken next, and the
ones after it, before those the queue held before it. The stripe it waits in is
cut at its block: a 4 MiB read far into a file waits for one block, not for the
blocks of its stripe in front of it. Each holder gets
a few workers (one data connection each) that take the next stripe off the
queue: a fast holder takes more of them. A holder whose transfer fails, stalls
(STALL_TIMEOUT without a byte: a stopped or cut-off host) or sends a block that
does not verify is dropped for this file, and the rest of its stripe goes back
to the front of the queue for the others. Blocks verified before that stay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import trio

H = TypeVar("H")

STRIPE_BLOCKS = 4  # 16 MiB: few requests per GiB, yet spread over holders


class StripeFailed(OSError):
    """No holder could deliver the remaining blocks; `errors` says what each said."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__(5, "no holder could deliver it (" + ("; ".join(
            f"{n}: {type(e).__name__}: {e}" for n, e in errors.items()) or "no holder") + ")")
        self.errors = errors


class Progress:
    """The next block of a stripe not yet verified, and the bytes verified (advanced by
    the worker thread)."""

    def __init__(self, first: int) -> None:
        self.next = first
        self.bytes = 0


class Striped(Generic[H]):
    """fetch(holder, first, last, progress) fetches blocks [first, last) in a worker
    thread, advancing progress past each verified block; it raises on failure."""

    def __init__(self, fetch: Callable[[H, int, int, Progress], None], blocks: int,
                 workers_per_holder: int, limiter: trio.CapacityLimiter,
                 name: Callable[[H], str] = str, stripe: int = STRIPE_BLOCKS,
                 focus: Callable[[], int | None] = lambda: None) -> None:
        self.fetch = fetch
        self.focus = focus  # the block a reader waits at (None: none waits)
        self.todo: deque[tuple[int, int]] = deque(
            (i, min(i + stripe, blocks)) for i in range(0, blocks, stripe))
        self.workers_per_holder = max(1, workers_per_holder)
        self.limiter = limiter
        self.name = name
        self.bytes_by: dict[str, int] = {}  # bytes each holder delivered
        self.errors: dict[str, Exception] = {}  # holders dropped, and why

    async def run(self, holders: Sequence[H]) -> dict[str, int]:
        """Every block, from these holders; returns bytes delivered per holder name.
        Raises StripeFailed when every holder was dropped with blocks left."""
        while self.todo:
            live = [h for h in holders if self.name(h) not in self.errors]
            if not live:
                raise StripeFailed(self.errors)
            # Workers end when the queue is empty; a stripe that failed meanwhile
            # is put back, and the loop starts workers again for what is left.
            async with trio.open_nursery() as n:
                for h in live:
                    for _ in range(self.workers_per_holder):
                        n.start_soon(self._worker, h)
        return {n: b for n, b in self.bytes_by.items() if b}

    def _take(self) -> tuple[int, int]:
        """The next stripe: the one a reader waits in, from the block it waits at (the
        blocks before that stay queued), or the first after it; else the queue's head."""
        at = self.focus()
        if at is not None:
            for i, (first, last) in enumerate(self.todo):
                if last > at:
                    if first >= at and i == 0:
                        break  # the head is where the reader waits: file order
                    if first < at:
                        self.todo[i] = (first, at)
                        return at, last
                    del self.todo[i]
                    return first, last
        return self.todo.popleft()

    async def _worker(self, h: H) -> None:
        name = self.name(h)
        while self.todo and name not in self.errors:
            first, last = self._take()
            progress = Progress(first)
            try:
                await trio.to_thread.run_sync(self.fetch, h, first, last, progress,
                                              limiter=self.limiter)
            except Exception as e:  # any failure drops the holder for this file
                self.errors.setdefault(name, e)
                if progress.next < last:
                    self.todo.appendleft((progress.next, last))
            finally:
                self.bytes_by[name] = self.bytes_by.get(name, 0) + progress.bytes
