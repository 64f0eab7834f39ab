"""Whole-job restores that read each object from the bucket once.

After a whole-job loss every host reads its files through from the durable
tier, and in data-parallel training many hosts read the same files. A host
that reads a persisted file through announces itself in the index as a
*source* of that version (Entry.sources) and serves each chunk to peers once
the chunk's crc32c matched (the object's recorded chunk crc32cs, CHUNK_META_KEY).

The chunks are split among the sources a host knows of by rendezvous hashing
(the owner of chunk c is the source with the highest hash of (file, c, node)):
every host computes the same split from the same set, and a source that joins
or leaves moves only its own share. Each host then

- reads the chunks it owns from the bucket (its bucket workers), but first asks
  the chunk's owner as it was before this host joined: a late joiner takes
  what earlier sources already have or are reading;
- takes every other chunk from its owner over the data channel (its peer
  workers): the owner sends it once verified, and answers "wait" (a keepalive)
  while it is still reading it from the bucket or will;
- reads a chunk from the bucket itself when its owner says it will not have it
  (their views of the sources differed for a moment), and drops a source that
  fails, stalls or sends a chunk that does not verify: its share is
  re-assigned among the others (this host included), so a dead source never
  makes the restore fail.

A chunk from a peer is verified twice: each 4 MiB frame by the data channel's
MAC, the whole chunk by its recorded crc32c; only then is it shown to readers
or served to other peers (its bytes land in the file as they arrive, in a
range nobody reads until then; one worker fills a chunk at a time). So
simultaneous starters read the object from the bucket about once between them,
and a host that arrives later reads it from the hosts that have it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import google_crc32c
import trio

from mtcfs.core.checksums import IntegrityError

log = logging.getLogger(__name__)

TODO, CHECKING, BUCKET, PEER, DONE = "todo", "checking", "bucket", "peer", "done"
SETTLE = 0.25  # a first source waits this long for simultaneous starters' announcements
SETTLE_CHUNKS = 4  # ... of a file this many chunks long (a small file is not worth it)
IDLE_POLL = 0.2  # a worker with nothing to take looks again (the sources may change)
NO_PROGRESS = 15.0  # a source waited on that verified nothing for this long stops waiting
REFUSALS = 3  # an owner that refused a chunk this often: read from the bucket here
PRECHECKS = 3  # sources asked for a chunk of this host's share before the bucket


def score(guid: str, chunk: int, node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{guid}\0{chunk}\0{node_id}".encode(),
                                          digest_size=8).digest(), "big")


def owner(guid: str, chunk: int, sources: list[str]) -> str | None:
    """The source that reads `chunk` from the bucket (rendezvous hashing)."""
    return max(sources, key=lambda s: score(guid, chunk, s), default=None)


class Refusal(Exception):
    """The source will not have the chunk (not its share, not in flight there)."""


@dataclass
class Restore:
    """One file's restore on this host: the state of each chunk, what peers wait on."""

    node_id: str
    guid: str
    version: int
    size: int
    chunk: int
    crcs: list[int]
    dest: int  # st_ino of the RAM file it fills
    view: Callable[[], list[str]]  # live sources known (this host included)
    state: list[str] = field(default_factory=list)
    forced: set[int] = field(default_factory=set)  # owner refused: from the bucket here
    failed: dict[str, str] = field(default_factory=dict)  # sources dropped, and why
    changed: trio.Event = field(default_factory=trio.Event)
    last_progress: float = field(default_factory=time.monotonic)
    bucket_bytes: int = 0
    peer_bytes: dict[str, int] = field(default_factory=dict)
    refusals: dict[int, int] = field(default_factory=dict)  # chunk -> its owners' refusals
    not_before: dict[int, float] = field(default_factory=dict)  # chunk -> ask again then
    from_before: int = 0  # chunks of this host's share an earlier source had
    error: str | None = None
    # Set when the restore ends early: worker threads waiting on a peer give up.
    stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.state = [TODO] * len(self.crcs)

    @property
    def chunks(self) -> int:
        return len(self.crcs)

    def span(self, c: int) -> tuple[int, int]:
        off = c * self.chunk
        return off, min(self.chunk, self.size - off)

    def sources(self) -> list[str]:
        return [s for s in self.view() if s not in self.failed]

    def owner_of(self, c: int, sources: list[str] | None = None) -> str | None:
        if c in self.forced:
            return self.node_id
        return owner(self.guid, c, self.sources() if sources is None else sources)

    def complete(self) -> bool:
        return all(s == DONE for s in self.state)

    def will_have(self, c: int, wait: bool) -> bool:
        """Whether a peer asking for chunk c should wait for it here: it is being read
        from the bucket, or (wait) it is this host's share and not given up."""
        if self.error is not None:
            return False
        st = self.state[c]
        if st == BUCKET:
            return True
        return wait and st in (TODO, CHECKING) and self.owner_of(c) == self.node_id

    def wake(self, progress: bool = False) -> None:
        if progress:
            self.last_progress = time.monotonic()
        self.changed.set()
        self.changed = trio.Event()


# fetch_peer(source, chunk, wait) fetches a chunk from a source into the file in a
# worker thread: True when it arrived verified, False when the source refused (it will
# not have it); raises when the source failed (dropped for this restore).
PeerFetch = Callable[[str, int, bool], bool]
BucketFetch = Callable[[int], None]  # reads a chunk from the bucket, verifies, writes


async def run(r: Restore, fetch_peer: PeerFetch, fetch_bucket: BucketFetch,
              on_verified: Callable[[int, int], None], bucket_workers: int,
              peer_workers: int, per_source: int,
              limiter: trio.CapacityLimiter | None = None) -> None:
    """Fill the file with every chunk (see the module's docstring); raises what a
    bucket read raised (the restore fails as a plain read-through would)."""
    in_flight: dict[str, int] = {}  # peer requests per source (bounded: its connections)

    def done(c: int) -> None:
        r.state[c] = DONE
        off, length = r.span(c)
        on_verified(off, length)
        r.wake(progress=True)

    async def from_bucket(c: int) -> None:
        r.state[c] = CHECKING
        sources = r.sources()
        if c not in r.forced and r.node_id in sources and len(sources) > 1:
            # Another source may have owned it in its view without this host (it was
            # there first, or had not heard of this host yet): take it from there if
            # it has it, or is reading it. Such a source is the highest-ranked in its
            # own view: the next ones after this host in the ranking.
            ranked = sorted((s for s in sources if s != r.node_id),
                            key=lambda s: score(r.guid, c, s), reverse=True)
            for before in ranked[:PRECHECKS]:
                if await _ask(before, c, wait=False):
                    r.from_before += 1
                    return
                if r.state[c] != CHECKING:
                    return
        if r.state[c] != CHECKING:
            return
        r.state[c] = BUCKET
        r.wake()
        try:
            await trio.to_thread.run_sync(fetch_bucket, c, limiter=limiter)
        except BaseException as e:
            r.state[c] = TODO
            r.error = r.error or f"{type(e).__name__}: {e}"
            r.stopped.set()  # the restore fails: the other workers stop waiting
            r.wake()
            raise
        r.bucket_bytes += r.span(c)[1]
        done(c)

    async def _ask(src: str, c: int, wait: bool) -> bool:
        in_flight[src] = in_flight.get(src, 0) + 1
        try:
            got = await trio.to_thread.run_sync(fetch_peer, src, c, wait, limiter=limiter)
        except Exception as e:  # any failure drops the source for this restore
            r.failed.setdefault(src, f"{type(e).__name__}: {e}")
            log.warning("restore of %s: source %s dropped (%s); its share goes elsewhere",
                        r.guid, src, r.failed[src])
            r.wake()
            return False
        finally:
            in_flight[src] -= 1
        if got:
            r.peer_bytes[src] = r.peer_bytes.get(src, 0) + r.span(c)[1]
            done(c)
        return got

    async def from_peer(c: int, src: str) -> None:
        r.state[c] = PEER
        if not await _ask(src, c, wait=True) and src not in r.failed:
            # Its view of the sources differs from ours for now (an announcement on its
            # way): ask again in a moment, under the views then; a few refusals in a
            # row, and this host reads it itself.
            n = r.refusals[c] = r.refusals.get(c, 0) + 1
            if n >= REFUSALS:
                r.forced.add(c)
            else:
                r.not_before[c] = time.monotonic() + 0.1 * n
        if r.state[c] != DONE:
            r.state[c] = TODO
            r.wake()

    def next_chunk(mine: bool) -> tuple[int, str] | None:
        sources = r.sources()
        now = time.monotonic()
        for c, st in enumerate(r.state):
            if st != TODO or r.not_before.get(c, 0.0) > now:
                continue
            o = r.owner_of(c, sources) or r.node_id
            if (o == r.node_id) != mine:
                continue
            if not mine and in_flight.get(o, 0) >= per_source:
                continue
            return c, o
        return None

    async def worker(mine: bool) -> None:
        while not r.complete() and r.error is None:
            pick = next_chunk(mine)
            if pick is None:
                with trio.move_on_after(IDLE_POLL):
                    await r.changed.wait()
                continue
            c, src = pick
            if mine:
                await from_bucket(c)
            else:
                await from_peer(c, src)

    async def sentinel() -> None:
        # Cancelled (the file is unlinked, the mount stops) or failed: peers waiting
        # on this host's share hear "no" at once, and this host's threads waiting on
        # peers give up at their next keepalive (they cannot be cancelled: they write
        # into the file).
        try:
            await trio.sleep_forever()
        finally:
            if not r.complete():
                r.error = r.error or "the restore stopped"
                r.stopped.set()
                r.wake()

    async with trio.open_nursery() as outer:
        outer.start_soon(sentinel)
        async with trio.open_nursery() as n:
            for _ in range(bucket_workers):
                n.start_soon(worker, True)
            for _ in range(peer_workers):
                n.start_soon(worker, False)
        outer.cancel_scope.cancel()


def read_chunk(r: Restore, fd: int, c: int, read: Callable[[int, int], bytes],
               what: str) -> None:
    """Chunk c from the bucket into fd, once its crc32c matched (read twice before
    IntegrityError: the bytes may have been damaged on the way)."""
    off, n = r.span(c)
    for attempt in range(2):
        data = read(off, n)
        if len(data) == n and google_crc32c.value(data) == r.crcs[c]:
            os.pwrite(fd, data, off)
            return
        log.warning("%s: bytes %d-%d arrived damaged (attempt %d)", what, off, off + n - 1,
                    attempt + 1)
    err = IntegrityError(f"{what}: bytes {off}-{off + n - 1} do not match the object's "
                         "recorded crc32c (read twice); data discarded")
    err.bad_range = (off, off + n)
    raise err


async def wait_for(r: Restore, c: int, wait: bool, timeout: float) -> str:
    """For a peer's request: "ready" (verified here), "wait" (still coming, ask again),
    or "no" (this host will not have it)."""
    with trio.move_on_after(timeout):
        while True:
            if r.state[c] == DONE:
                return "ready"
            if not r.will_have(c, wait) or time.monotonic() - r.last_progress > NO_PROGRESS:
                return "no"
            await r.changed.wait()
    return "ready" if r.state[c] == DONE else "wait"

