"""Read-through: files whose data is not in the local RAM tier are fetched
when opened — from a peer that holds them, else from the durable tier — and
cached in the RAM tier. The bucket's tree is merged into the namespace.

Listing policy: the whole prefix is listed when the daemon starts (before the
mount is announced live, so a fresh mount over a bucket shows every step at
once) and again every `refresh` seconds in the background. A refresh adds
objects that appeared and picks up newer generations of files this node holds
only as persisted copies; it never removes or overwrites local changes.

Fetching: an open of a file whose data is not in RAM starts one background
download into the RAM tier, in chunks fetched in parallel. Each chunk is
verified against the per-chunk crc32c recorded at upload before any reader
sees it, so reads start before the whole file has arrived; objects written by
other tools (no per-chunk checksums) are served once the whole object's crc32c
has matched. Bad data is never served.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import pyfuse3
import trio

from mtcfs.fs.namespace import CLOSED, ROOT, Inode, Namespace
from mtcfs.tiers.durable import DurableError, DurableTier, IntegrityError, ObjectInfo
from mtcfs.tiers.ram import RamTier

if TYPE_CHECKING:
    from mtcfs.peer.tier import PeerTier

log = logging.getLogger(__name__)

DEFAULT_REFRESH = 30.0
NAME_MAX = 255
# Fetches a read of a good range tries before EIO when fetches fail elsewhere in the file.
READ_ATTEMPTS = 4


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
    integrity_errors: int = 0
    errors: int = 0
    last_error: str = ""
    listed_objects: int = 0
    last_refresh: float = 0.0


class ReadThrough:
    def __init__(self, ns: Namespace, ram: RamTier, tier: DurableTier | None,
                 refresh: float = DEFAULT_REFRESH, parallel: int = 4,
                 peers: PeerTier | None = None) -> None:
        self.ns = ns
        self.ram = ram
        self.tier = tier
        self.peers = peers
        self.refresh = refresh
        self.parallel = parallel
        self.fetches: dict[int, Fetch] = {}
        self.stats = Stats()
        self.sources: dict[str, int] = {}  # bytes fetched, by where they came from
        self.prefetch_errors: dict[int, str] = {}
        self._nursery: trio.Nursery | None = None
        # Evicts safe copies for a fetch that does not fit (set by the daemon).
        self.make_room: Callable[[int], bool] = lambda need: False
        # (parent ino, name, old ino) of files a refresh replaced by a new inode
        self._replaced: list[tuple[int, bytes, int]] = []

    # -- the tree ----------------------------------------------------------------

    def listing(self) -> list[ObjectInfo]:
        """Every object under the prefix (blocking: at start-up, or in a worker thread)."""
        assert self.tier is not None
        objects = list(self.tier.list(""))
        self.stats.listed_objects = len(objects)
        self.stats.last_refresh = time.time()
        return objects

    async def load(self, pending_deletes: set[str], full: bool = True) -> int:
        objects = await trio.to_thread.run_sync(self.listing)
        changed = self.merge(objects, pending_deletes, full)
        await self._invalidate_replaced()
        return changed

    async def _invalidate_replaced(self) -> None:
        """Make the kernel drop its entries of files a refresh replaced, so the next
        lookup finds the new inode (size, data). From a worker thread: the
        notification may block while the kernel writes back."""
        entries, self._replaced = self._replaced, []
        for parent, name, old in entries:
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name, old)
            except OSError as e:
                log.debug("invalidating %r: %s", name, e)  # ENOENT: nothing cached

    def merge(self, objects: list[ObjectInfo], pending_deletes: set[str], full: bool) -> int:
        """Bring the namespace in line with a listing; returns files added or updated."""
        changed = 0
        seen: set[int] = set()
        with self.ns.store.transaction():
            for obj in objects:
                if obj.key in pending_deletes or obj.key.endswith("/"):
                    continue
                node = self._merge_object(obj)
                if node is not None:
                    seen.add(node.ino)
                    changed += 1
            if full:
                self._forget_vanished(seen)
        return changed

    def _merge_object(self, obj: ObjectInfo) -> Inode | None:
        parts = [p.encode("utf-8", "surrogateescape") for p in obj.key.split("/")]
        if any(len(p) > NAME_MAX for p in parts):
            log.warning("skipping bucket object %s: a name is longer than %d bytes", obj.key,
                        NAME_MAX)
            return None
        d = self.ns.inodes[ROOT]
        for comp in parts[:-1]:
            child = self.ns.child(d, comp)
            if child is None:
                child = self.ns.new_inode(d, comp, stat.S_IFDIR | 0o755, 0, 0)
            elif not child.is_dir:
                log.warning("skipping bucket object %s: %s is a file here", obj.key,
                            self.ns.path_of(child))
                return None
            d = child
        node = self.ns.child(d, parts[-1])
        if node is None:
            node = self.ns.new_inode(d, parts[-1], stat.S_IFREG | 0o644, 0, 0,
                                     global_id=object_guid(obj))
            self._take_remote(node, obj)
            node.has_data = False
            self.ns.persist(node)
            return node
        if not node.is_file:
            log.warning("skipping bucket object %s: a directory has that name here", obj.key)
            return None
        if node.generation == obj.generation:
            return node
        if node.state == CLOSED and node.crc32c == obj.crc32c and node.size == obj.size:
            # The same bytes (e.g. our upload landed just before a crash): adopt it.
            node.generation = obj.generation
            node.persisted_version = node.version
        elif node.persisted and not node.opens:
            return self._replace(d, parts[-1], node, obj)
        else:
            log.warning("bucket object %s differs from the local, unpersisted file: keeping "
                        "the local one", obj.key)
            return node
        self.ns.persist(node)
        return node

    def _replace(self, d: Inode, name: bytes, old: Inode, obj: ObjectInfo) -> Inode:
        """A newer object written elsewhere replaces our persisted copy. It gets a
        new inode: with the writeback cache the kernel trusts its own size of a
        file it has cached, so only a new file shows the new size."""
        # A fetch of the old generation still running writes into the removed
        # data file; the next open fetches the new object.
        self.fetches.pop(old.ino, None)
        self.ns.unlink(d, name)
        old.stale = True
        self.ram.remove(old.ino)
        if old.lookups:
            self.ns.store.delete_inode(old.ino)  # forgotten when the kernel lets go
        else:
            self.ns.drop(old)
        node = self.ns.new_inode(d, name, old.mode, old.uid, old.gid,
                                 global_id=object_guid(obj))
        self._take_remote(node, obj)
        node.version = old.version + 1
        node.persisted_version = node.version
        node.has_data = False
        node.xattrs = dict(old.xattrs)
        for key, value in node.xattrs.items():
            self.ns.store.put_xattr(node.ino, key, value)
        self.ns.persist(node)
        self._replaced.append((d.ino, name, old.ino))
        return node

    @staticmethod
    def _take_remote(node: Inode, obj: ObjectInfo) -> None:
        node.state = CLOSED
        node.size = obj.size
        node.crc32c = obj.crc32c
        node.generation = obj.generation
        node.version = max(node.version, 1)
        node.persisted_version = node.version
        node.mtime_ns = node.ctime_ns = int(obj.updated * 1e9)

    def _forget_vanished(self, seen: set[int]) -> None:
        """Files we knew as persisted whose objects are gone from the bucket."""
        for node in list(self.ns.files()):
            if node.ino in seen or not node.generation or not node.linked:
                continue
            node.generation = 0
            node.persisted_version = 0
            if node.has_data or node.opens:
                self.ns.persist(node)  # ours is now the only copy: persisted again per policy
            else:
                log.warning("%s is gone from the bucket and not in RAM: removing it",
                            self.ns.path_of(node))
                self.ns.unlink(self.ns.inodes[node.parent], node.name)
                self.ns.drop(node)

    async def refresh_loop(self, pending_deletes: set[str]) -> None:
        assert self.tier is not None
        while True:
            await trio.sleep(self.refresh)
            try:
                await self.load(pending_deletes, full=False)
            except (DurableError, OSError) as e:
                self._error(f"listing {self.tier.url}: {e}")

    # -- fetching ----------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await trio.sleep_forever()

    def start(self, node: Inode) -> Fetch:
        f = self.fetches.get(node.ino)
        if f is not None and f.error is None:
            return f
        if node.size > self.ram.capacity - self.ram.used:
            self.make_room(node.size)
        free = self.ram.capacity - self.ram.used
        f = self.fetches[node.ino] = Fetch(node.size)
        if node.size > free:
            f.fail(f"RAM tier full: {node.size} bytes needed, {free} free")
            return f
        assert self._nursery is not None
        # Always a new file (the handles' shared fd is moved onto it): a read that
        # relied on an earlier, failed fetch still finds that fetch's file (emptied)
        # behind its fd, never this one being filled (zeros, chunks in flight).
        self.ram.replace(node.ino)
        # A private fd, not the handles' shared one: unlinking the file while it is
        # fetched closes that (ram.remove), and the download threads would then write
        # into whatever file or socket reuses the fd number. Opened now, so that the
        # download cannot end up in a file that replaced this one meanwhile.
        fd = os.open(self.ram.path(node.ino), os.O_RDWR | os.O_CLOEXEC)
        f.dest = os.fstat(fd).st_ino
        self.ram.reserve(node.ino, node.size)
        self._nursery.start_soon(self._fetch, node, f, fd)
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
                return os.stat(self.ram.path(node.ino)).st_ino == dest
            except FileNotFoundError:
                return False

        def on_verified(off: int, length: int) -> None:
            trio.from_thread.run_sync(f.add, off, length, trio_token=token)

        t0 = time.monotonic()
        source = ""
        try:
            if self.peers is not None and [h for h in node.holders
                                           if h != self.peers.node_id]:
                try:
                    source = await self.peers.download(node, fd, f.add)
                except OSError as e:
                    if self.tier is None or not generation:
                        raise
                    log.warning("%s: %s; reading it from %s", key, e, self.tier.url)
            if not source:
                if self.tier is None or not generation:
                    raise OSError(errno.EIO, "no copy is reachable: not on a live peer"
                                  + ("" if self.tier is None else " nor in the durable tier"))
                await trio.to_thread.run_sync(partial(
                    self.tier.download, key, fd, parallel=self.parallel,
                    on_verified=on_verified, generation=generation))
                source = self.tier.url
        except IntegrityError as e:
            self.stats.integrity_errors += 1
            self._error(f"{key}: {e}")
            f.fail(str(e), e.bad_range)
        except (DurableError, OSError) as e:
            self._error(f"fetching {key}: {e}")
            f.fail(str(e))
        else:
            if (self.ns.get(node.ino) is node and node.linked and not node.dirty
                    and node.generation == generation and node.version == version
                    and still_the_data_file()):
                node.has_data = True
                node.cached = True  # evictable while another copy exists (lifecycle)
                if self.peers is not None and self.peers.node_id not in node.holders:
                    node.holders.append(self.peers.node_id)
                with self.ns.store.transaction():
                    self.ns.persist(node)
            self.stats.fetched_files += 1
            self.stats.fetched_bytes += node.size
            self.sources[source] = self.sources.get(source, 0) + node.size
            log.info("fetched %s from %s (%d bytes) in %.2f s", key, source, node.size,
                     time.monotonic() - t0)
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
        if self._nursery is not None:
            self._nursery.start_soon(fn)

    def prefetch(self, nodes: list[Inode], parallel: int = 4) -> None:
        """Fetch these files into the RAM tier in the background, `parallel` at a time
        (`mtcfs prefetch`); failures are kept in prefetch_errors."""
        assert self._nursery is not None
        limiter = trio.CapacityLimiter(parallel)

        async def one(node: Inode) -> None:
            async with limiter:
                if node.has_data or not node.linked:
                    return
                try:
                    await self.wait_complete(node)
                except OSError as e:
                    self.prefetch_errors[node.ino] = e.strerror or str(e)

        for node in nodes:
            self.prefetch_errors.pop(node.ino, None)
            self._nursery.start_soon(one, node)

    def fetching(self, node: Inode) -> bool:
        """A download of this file is under way."""
        f = self.fetches.get(node.ino)
        return f is not None and not (f.done or f.error)

    def fetched_bytes(self, node: Inode) -> int:
        """Bytes of a file in the RAM tier (verified so far, while it is fetched)."""
        if node.has_data:
            return node.size
        f = self.fetches.get(node.ino)
        return sum(e - s for s, e in f.ranges) if f is not None else 0

    async def wait_range(self, node: Inode, off: int, size: int) -> None:
        end = min(off + size, node.size)
        f = self.fetches.get(node.ino) or self.start(node)
        while not node.has_data and not f.covers(off, end):
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
            "integrity_errors": self.stats.integrity_errors,
            "errors": self.stats.errors,
            "last_error": self.stats.last_error or None,
            "listed_objects": self.stats.listed_objects,
            "refresh_seconds": self.refresh,
            "bytes_by_source": dict(self.sources),
        }


def object_guid(obj: ObjectInfo) -> str:
    """The index id of a file known from the bucket: the same on every host that
    lists it, so hosts merging their listings agree on one entry."""
    return "gcs" + hashlib.sha256(f"{obj.key}\0{obj.generation}".encode()).hexdigest()[:29]
