"""Fetching files whose data is not in this host's RAM tier: from a peer that holds
them, else from the durable tier; the copy is kept (a cache copy).

An open of such a file starts one background download into the RAM tier. Every
block (from a peer) or chunk (from the bucket) is verified against its recorded
crc32c before any reader sees it, so reads start before the whole file has
arrived; objects written by other tools (no per-chunk checksums) are served
once the whole object's crc32c has matched. Bad data is never served.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from mtcfs.core.checksums import IntegrityError
from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.tiers.durable import DurableError, DurableTier
from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

# Fetches a read of a good range tries before EIO when fetches fail elsewhere in the file.
READ_ATTEMPTS = 4

# A reader's open of a file that a step's read-ahead is bringing whole waits for it
# (then reads it in RAM, through passthrough) when the rest is due within this many
# seconds: the daemon's replies to each read and the fetch would share the cores.
# A file due later (a slice of a large shard) is read as it arrives.
STEP_OPEN_WAIT = 0.5
# The rate assumed until a fetch of RATE_BYTES or more has been timed (bytes/s), and
# how much a fetch must have moved before its own rate is trusted.
ASSUMED_RATE = 1 << 30  # (a 10 Gbit/s link)
RATE_BYTES = 16 << 20


class PeerSource(Protocol):
    """Where copies held by other hosts come from (the peer tier)."""

    node_id: str

    async def restore(self, node: Inode, fd: int, tier: DurableTier, key: str, generation: int,
                      parallel: int, on_verified: Callable[[int, int], None]
                      ) -> dict[str, int] | None:
        """Read a persisted file through together with the other hosts reading it (each
        its share of the bucket's chunks); None: read it from the bucket alone."""
        ...

    async def download(self, node: Inode, fd: int, on_verified: Callable[[int, int], None],
                       focus: Callable[[], int | None] = lambda: None) -> dict[str, int]:
        """Fill fd with the node's version from its holders (blocks from several at
        once); returns the bytes each holder (node id) delivered. focus(): the offset a
        reader waits at, fetched next (None: file order)."""
        ...


class Room(Protocol):
    """Room in the RAM tier (mtcfs.lifecycle.space)."""

    async def make_room(self, need: int, what: str) -> None:
        """Make `need` bytes free, waiting (bounded) for data to become evictable;
        raises OSError(ENOSPC) when none came."""
        ...


@dataclass
class Fetch:
    """One file's download: verified byte ranges, and who waits for them."""

    size: int
    ranges: list[tuple[int, int]] = field(default_factory=list)  # merged [start, end)
    changed: trio.Event = field(default_factory=trio.Event)
    error: str | None = None
    bad: tuple[int, int] | None = None  # the range that failed verification, if known
    done: bool = False
    bytes: int = 0
    dest: int = 0  # st_ino of the RAM file this fetch fills (a new one per fetch)
    # Where the last read that had to wait asked: fetched next, and on from there (a
    # ranged read of a large file is not served after everything before it).
    focus: int | None = None
    started: float = field(default_factory=time.monotonic)

    def verified(self) -> int:
        """Bytes verified and in the RAM file so far."""
        return sum(e - s for s, e in self.ranges)

    def eta(self, rate: float, now: float) -> float:
        """Seconds until every byte is here: at this fetch's own rate once it has
        moved RATE_BYTES, else at `rate` (bytes/s)."""
        left = self.size - self.verified()
        if self.bytes >= RATE_BYTES and now > self.started:
            rate = self.bytes / (now - self.started)
        return left / rate if rate > 0 else math.inf

    def add(self, off: int, length: int) -> None:
        self.bytes += length
        start, end = off, off + length
        merged = []
        for s, e in self.ranges:
            if e < start or s > end:
                merged.append((s, e))
            else:
                start, end = min(s, start), max(e, end)
        merged.append((start, end))
        self.ranges = sorted(merged)
        self._wake()

    def fail(self, msg: str, bad: tuple[int, int] | None = None) -> None:
        self.error = msg
        self.bad = bad
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def covers(self, start: int, end: int) -> bool:
        if start >= end:
            return True
        return any(s <= start and end <= e for s, e in self.ranges)


@dataclass
class Stats:
    fetched_files: int = 0
    fetched_bytes: int = 0
    durable_bytes: int = 0  # of fetched_bytes, read from the durable tier
    integrity_errors: int = 0
    errors: int = 0
    last_error: str = ""



class _Tasks:
    """The fetches' background tasks: started in the Fetcher's nursery once it runs
    (a fetch asked for before then is a bug: the daemon runs it before serving)."""

    def __init__(self) -> None:
        self.nursery: trio.Nursery | _NotRunning = _NotRunning()

    def run_in(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    @property
    def running(self) -> bool:
        return not isinstance(self.nursery, _NotRunning)

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        self.nursery.start_soon(fn, *args)


class _NotRunning:
    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        raise RuntimeError("the fetcher is not running yet")

class Fetcher(Listener):
    """Downloads into the RAM tier. `copies` records a completed copy; `events` says
    when one fails; `room` makes room for it; `tier` (None without a bucket) and
    `peers` are where copies come from (mtcfs.absent's NoDurable and NoPeers when not
    configured: they hold nothing). It listens for
    `copy_wanted` (the uploader needs a file here)."""

    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                 room: Room, tier: DurableTier, peers: PeerSource, parallel: int = 4) -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.events = events
        self.room = room
        self.tier = tier
        self.peers = peers
        self.parallel = parallel
        self.fetches: dict[int, Fetch] = {}
        self.stats = Stats()
        self.sources: dict[str, int] = {}  # bytes fetched, by where they came from
        self.prefetch_errors: dict[int, str] = {}
        # The files of the prefetches under way (a new batch starts once all are done).
        self.prefetching: list[Inode] = []
        # Files fetched whole ahead of readers (prefetch, a replacement's restore).
        self._ahead: set[int] = set()
        # A step's files fetched because a reader opened one of them (step_ahead).
        self._stepping: set[int] = set()
        self.rate: float = ASSUMED_RATE  # bytes/s of the last whole fetch timed
        self._step_limiter = trio.CapacityLimiter(parallel)
        self._tasks = _Tasks()  # the fetches' nursery, once run() has started

    def busy(self, node: Inode) -> bool:
        """A download of this file is under way."""
        f = self.fetches.get(node.ino)
        return f is not None and not (f.done or f.error)

    fetching = busy

    def open_wait(self, node: Inode) -> float | None:
        """How long a reader's open of `node` (not here) waits for the whole file, to
        read it in RAM (passthrough) rather than read by read through the daemon while
        it arrives; None: it does not wait. A fetch asked for ahead of readers (a
        prefetch, a replacement's restore) is waited for; one of a step's read-ahead,
        when the rest is due within STEP_OPEN_WAIT (up to a few times that, should it
        slow down)."""
        if node.ino in self._ahead and self.busy(node):
            return math.inf
        if node.ino not in self._stepping:
            return None
        f = self.fetches.get(node.ino)
        due = (f.eta(self.rate, time.monotonic()) if f is not None and f.error is None
               else node.size / self.rate)
        return 4 * due + 0.1 if due <= STEP_OPEN_WAIT else None

    async def fetch_ahead(self, node: Inode, limiter: trio.CapacityLimiter,
                          failed: dict[int, str]) -> None:
        """The whole file into the RAM tier ahead of its readers, under `limiter` (a
        batch's bound): nothing when it is here or gone; why it failed kept in
        `failed` (ino -> why)."""
        async with limiter:
            if node.has_data or not node.linked:
                return
            self._ahead.add(node.ino)
            try:
                await self.wait_complete(node)
            except OSError as e:
                failed[node.ino] = e.strerror or str(e)
            finally:
                self._ahead.discard(node.ino)

    def step_ahead(self, files: list[Inode]) -> None:
        """A reader opened one file of a committed step that is not here: the step's
        other files not here are fetched too, in the background, `parallel` at a
        time (a load reads a step's files one after the other: each is then here,
        or under way, when it is opened). Only copies live peers hold (a step
        evicted here and read from the bucket is not pulled back whole), and only
        what fits in the RAM tier now."""
        if not self._tasks.running:
            return
        todo = [n for n in files if n.is_file and n.linked and not n.has_data
                and n.state == CLOSED and not self.busy(n) and n.ino not in self._stepping
                and self.copies.elsewhere(n)]
        if not todo or sum(n.size for n in todo) > self.ram.free:
            return
        self._stepping.update(n.ino for n in todo)

        async def one(node: Inode) -> None:
            async with self._step_limiter:
                try:
                    if not node.has_data and node.linked:
                        await self.wait_complete(node)
                except OSError as e:  # said by the fetch; a reader will ask again
                    log.debug("step read-ahead of %s: %s", self.ns.path_of(node), e)
                finally:
                    self._stepping.discard(node.ino)

        for node in todo:
            self._tasks.start_soon(one, node)

    def copy_wanted(self, node: Inode) -> None:
        """(Listener) Fetch it in the background (once at a time)."""
        if not node.has_data and not self.busy(node) and self._tasks.running:
            self.start(node)

    # -- fetching ----------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._tasks.run_in(nursery)
            await trio.sleep_forever()

    def start(self, node: Inode) -> Fetch:
        f = self.fetches.get(node.ino)
        if f is not None and f.error is None:
            return f
        f = self.fetches[node.ino] = Fetch(node.size)
        # Always a new file (the handles' shared fd is moved onto it): a read that
        # relied on an earlier, failed fetch still finds that fetch's file (emptied)
        # behind its fd, never this one being filled (zeros, chunks in flight).
        self.ram.replace(node.ino)
        # A private fd, not the handles' shared one: unlinking the file while it is
        # fetched closes that (ram.remove), and the download threads would then write
        # into whatever file or socket reuses the fd number. Opened now, so that the
        # download cannot end up in a file that replaced this one meanwhile.
        fd = self.ram.open_fill(node.ino)
        f.dest = os.fstat(fd).st_ino
        self._tasks.start_soon(self._fetch, node, f, fd)
        return f

    async def _fetch(self, node: Inode, f: Fetch, fd: int) -> None:
        key = self.ns.path_of(node)
        generation = node.generation
        version = node.version
        token = trio.lowlevel.current_trio_token()
        dest = f.dest

        def still_the_data_file() -> bool:
            """False once the file was replaced (O_TRUNC, truncate to 0) or removed."""
            try:
                return self.ram.stat(node.ino).st_ino == dest
            except FileNotFoundError:
                return False

        def on_verified(off: int, length: int) -> None:
            trio.from_thread.run_sync(f.add, off, length, trio_token=token)

        t0 = time.monotonic()
        sources: dict[str, int] = {}
        try:
            if node.size > self.ram.free:
                # Readers wait while uploads or replication make room (bounded).
                await self.room.make_room(node.size, key)
            self.ram.reserve(node.ino, node.size)
            if [h for h in node.holders if h != self.peers.node_id]:
                try:
                    sources = await self.peers.download(node, fd, f.add,
                                                        focus=lambda: f.focus)
                except OSError as e:
                    if not self.tier.may_hold(generation):
                        raise
                    log.warning("%s: %s; reading it from %s", key, e, self.tier.url)
            if not sources:
                if not self.tier.may_hold(generation):
                    raise OSError(errno.EIO, "no copy is reachable: not on a live peer"
                                  + (" nor in the durable tier" if self.tier.url else ""))
                # Other hosts may read the same file now (a whole-job restore): the
                # bucket is read about once between them (None: read it alone).
                restored = await self.peers.restore(node, fd, self.tier, key, generation,
                                                    self.parallel, f.add)
                if restored is None:
                    await trio.to_thread.run_sync(partial(
                        self.tier.download, key, fd, parallel=self.parallel,
                        on_verified=on_verified, generation=generation))
                    restored = {self.tier.url: node.size}
                sources = restored
        except IntegrityError as e:
            self.stats.integrity_errors += 1
            self._error(f"{key}: {e}")
            f.fail(str(e), e.bad_range)
            self.events.fetch_failed(node, str(e))
        except (DurableError, OSError) as e:
            self._error(f"fetching {key}: {e}")
            f.fail(str(e))
            self.events.fetch_failed(node, str(e))
        else:
            if (self.ns.get(node.ino) is node and node.linked and not node.dirty
                    and node.generation == generation and node.version == version
                    and still_the_data_file()):
                self.copies.fetched(node)
            self.stats.fetched_files += 1
            self.stats.fetched_bytes += node.size
            for source, n in sources.items():
                self.sources[source] = self.sources.get(source, 0) + n
            self.stats.durable_bytes += sources.get(self.tier.url, 0)
            took = time.monotonic() - t0
            log.info("fetched %s from %s (%d bytes) in %.2f s", key, ", ".join(sources), node.size,
                     took)
            if node.size >= RATE_BYTES and took > 0 and self.tier.url not in sources:
                self.rate = node.size / took  # (from peers: what a step's read-ahead reads)
            f.finish()
        finally:
            os.close(fd)
            self.ram.reconcile(node.ino)
            if ((f.error is not None or not node.linked) and self.ram.fd(node.ino) is None
                    and still_the_data_file()):
                self.ram.remove(node.ino)
            # else open handles share this RAM file's fd: it stays (emptied by the
            # failed download) until a retry fetches into a new file (start()).
            if (f.done or f.error) and self.fetches.get(node.ino) is f:
                self.fetches.pop(node.ino)

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run fn in the fetches' nursery (after start-up)."""
        if self._tasks.running:
            self._tasks.start_soon(fn)

    def prefetch(self, nodes: list[Inode], parallel: int = 4) -> None:
        """Fetch these files into the RAM tier in the background, `parallel` at a time
        (`mtcfs prefetch`); failures are kept in prefetch_errors."""
        limiter = trio.CapacityLimiter(parallel)
        if self.prefetch_progress()["finished"]:
            self.prefetching = []
        self.prefetching.extend(nodes)
        for node in nodes:
            self.prefetch_errors.pop(node.ino, None)
            self._tasks.start_soon(self.fetch_ahead, node, limiter, self.prefetch_errors)

    def prefetch_progress(self) -> dict[str, Any]:
        """Of the prefetches under way or last finished: files and bytes wanted and done."""
        live = [n for n in self.prefetching if n.linked]
        return {"files_total": len(live),
                "files_done": sum(1 for n in live if n.has_data),
                "bytes_total": sum(n.size for n in live),
                "bytes_done": sum(self.fetched_bytes(n) for n in live),
                "failed": sum(1 for n in live if n.ino in self.prefetch_errors),
                "finished": all(n.has_data or n.ino in self.prefetch_errors for n in live)}

    def fetched_bytes(self, node: Inode) -> int:
        """Bytes of a file in the RAM tier (verified so far, while it is fetched)."""
        if node.has_data:
            return node.size
        f = self.fetches.get(node.ino)
        return f.verified() if f is not None else 0

    async def wait_range(self, node: Inode, off: int, size: int) -> None:
        end = min(off + size, node.size)
        f = self.fetches.get(node.ino) or self.start(node)
        while not node.has_data and not f.covers(off, end):
            f.focus = off
            if f.error is not None:
                raise OSError(errno.EIO, f.error)
            await f.changed.wait()

    async def read(self, node: Inode, fd: int, off: int, size: int) -> bytes:
        """pread(fd, size, off) of a file being read through: verified bytes or
        OSError(EIO), never anything else (a short result would be taken by the
        kernel as a hole of zeros).

        The bytes are kept only if, after the pread, the fetch that verified the
        range has not failed and its file is still the one behind fd at full
        length: a failing download empties its file from a worker thread at any
        moment, and a later fetch fills a new file. A read whose range is good but
        whose fetch failed elsewhere in the file (before or after verifying this
        range) tries a new fetch, a few times."""
        end = min(off + size, node.size)
        for _ in range(READ_ATTEMPTS):
            f = self.fetches.get(node.ino) or self.start(node)
            while not node.has_data and not f.covers(off, end) and f.error is None:
                f.focus = off
                await f.changed.wait()
            if node.has_data:
                return os.pread(fd, size, off)
            if f.covers(off, end):
                data = os.pread(fd, size, off)
                if (f.error is None and len(data) >= end - off
                        and os.fstat(fd).st_ino == f.dest):
                    return data
                # Emptied or replaced after the range was verified: let the fetch
                # settle (it is failing), then fetch again.
                while f.error is None and not f.done:
                    await f.changed.wait()
            elif f.bad is None or (f.bad[0] < end and off < f.bad[1]):
                raise OSError(errno.EIO, f.error)
            # else: failed in another chunk before this range was verified.
        raise OSError(errno.EIO, f"{self.ns.path_of(node)}: the download failed "
                                 f"{READ_ATTEMPTS} times")

    async def wait_complete(self, node: Inode) -> None:
        await self.wait_range(node, 0, node.size)
        f = self.fetches.get(node.ino)
        while f is not None and not f.done and not node.has_data:
            if f.error is not None:
                raise OSError(errno.EIO, f.error)
            await f.changed.wait()

    def _error(self, msg: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = msg
        log.error("%s", msg)

    def status(self) -> dict[str, object]:
        return {
            "fetching": len(self.fetches),
            "fetched_files": self.stats.fetched_files,
            "fetched_bytes": self.stats.fetched_bytes,
            "durable_bytes": self.stats.durable_bytes,
            "integrity_errors": self.stats.integrity_errors,
            "errors": self.stats.errors,
            "last_error": self.stats.last_error or None,
            "bytes_by_source": dict(self.sources),
            "prefetch": self.prefetch_progress(),
        }
