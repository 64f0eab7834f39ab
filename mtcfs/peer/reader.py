"""Reading another host's copy for this host's readers: from its live holders
(striped over the data channel, or one holder at a time over gRPC, each block
verified), or from the bucket together with the other hosts reading it through
(mtcfs.peer.restore). mtcfs.fetch drives it."""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import trio

from mtcfs.core.checksums import BLOCK, BlockVerifier, IntegrityError, block_count
from mtcfs.core.copies import Copies
from mtcfs.core.namespace import Inode, Namespace
from mtcfs.core.versions import MAX_SHARED_SIZE, local_only
from mtcfs.peer import restore
from mtcfs.peer.bulk import Remote
from mtcfs.peer.datachannel import DataChannel
from mtcfs.peer.membership import Membership, Peer
from mtcfs.peer.replicator import STALL_TIMEOUT, PeerSettings, Transfers
from mtcfs.peer.stats import PeerFetchError, Stats
from mtcfs.peer.striped import Progress, Striped
from mtcfs.peer.v1 import peer_pb2 as pb
from mtcfs.tiers.durable import DurableTier
from mtcfs.tiers.durable.base import chunk_plan

log = logging.getLogger(__name__)


# What a holder answers when it has no complete copy of the version asked for (it
# evicted it, or never had it: another host's view of the holders can be stale).
LACKS = ("FAILED_PRECONDITION", "NOT_FOUND")


class _Progress:
    """Shared between a transfer's worker thread and its watchdog."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.call: Any = None

    def tick(self) -> None:
        self.last = time.monotonic()


class PeerReader:
    def __init__(self, ns: Namespace, members: Membership, copies: Copies,
                 channel: DataChannel, stats: Stats, settings: PeerSettings,
                 transfers: Transfers) -> None:
        self.ns = ns
        self.members = members
        self.copies = copies
        self.channel = channel
        self.stats = stats
        self.node_id = settings.node_id
        self.transfers = transfers
        self.restores: dict[int, restore.Restore] = {}  # ino -> this host's restore of it

    def dropped_here(self, node: Inode) -> None:
        """This host's copy was evicted: no longer a source of its chunks."""
        self.restores.pop(node.ino, None)

    def restore_serving(self, node: Inode) -> restore.Restore | None:
        """This host's restore of `node`'s current version still under way (a peer asks
        for a chunk of it); None once done or replaced: the copy is served whole."""
        r = self.restores.get(node.ino)
        if r is not None and (r.version != node.version or node.has_data):
            self.restores.pop(node.ino, None)
            return None
        return r

    # -- restoring from the durable tier together (mtcfs.peer.restore) ---------------

    def restore_sources(self, node: Inode) -> list[str]:
        """This host and the live peers that announced they restore (or have) this
        version and offer a data channel."""
        return sorted({self.node_id} | {
            s for s in node.sources if s != self.node_id
            for p in [self.members.by_node(s)] if p is not None and p.data_port})

    async def restore(self, node: Inode, fd: int, tier: DurableTier, key: str,
                      generation: int, parallel: int,
                      on_verified: Callable[[int, int], None]) -> dict[str, int] | None:
        """Read a persisted file through with every other host restoring it: this host's
        share of its chunks from the bucket, the rest from the sources that have them
        (mtcfs.peer.restore). Returns the bytes read from each place (the bucket as
        tier.url), or None when the object cannot be restored so (no data channel, or
        no chunk crc32cs to verify peers' chunks with): the caller reads it alone."""
        if not self.channel.port or not node.size:  # (no data channel: no port)
            return None
        channel = self.channel
        info = await trio.to_thread.run_sync(tier.stat, key)
        if info is None or info.generation != generation or info.size != node.size:
            return None
        plan = chunk_plan(f"{tier.url}: {key}", info)
        if plan is None:
            return None
        chunk, crcs = plan
        guid, version, size, path = node.guid, node.version, node.size, key
        os.ftruncate(fd, size)
        r = restore.Restore(self.node_id, guid, version, size, chunk, crcs,
                            os.fstat(fd).st_ino, lambda: self.restore_sources(node))
        self.restores[node.ino] = r
        self.copies.restoring(node)
        if r.chunks >= restore.SETTLE_CHUNKS:
            # Hosts reading it at the same moment hear of each other within milliseconds:
            # a short pause lets them split the file instead of each reading from the
            # bucket what it owns in its own partial view of the sources. (Not for a
            # small file: many read one after the other would add up.)
            await trio.sleep(restore.SETTLE)
        token = trio.lowlevel.current_trio_token()

        def fetch_peer(src: str, c: int, wait: bool) -> bool:
            p = trio.from_thread.run_sync(self.members.by_node, src, trio_token=token)
            if p is None or not p.data_port:
                raise PeerFetchError(5, f"{src} is not live")
            off, n = r.span(c)
            return channel.fetch_chunk(p, fd, guid, version, path, off, n, crcs[c], wait,
                                       r.stopped.is_set)

        def fetch_bucket(c: int) -> None:
            restore.read_chunk(r, fd, c, lambda off, n: tier.read_range(
                key, off, n, generation=generation), f"{tier.url}: {key}")

        ok = False
        try:
            await restore.run(r, fetch_peer, fetch_bucket, on_verified, parallel,
                              2 * parallel, channel.connections)
            ok = True
        except BaseException as e:
            r.error = str(e) or type(e).__name__
            r.wake()
            raise
        finally:
            self.stats.restores += ok
            self.stats.restore_bucket_bytes += r.bucket_bytes
            self.stats.restore_peer_bytes += sum(r.peer_bytes.values())
            self.stats.restore_sources_dropped += len(r.failed)
            self.stats.restore_refusals += sum(r.refusals.values())
            self.stats.restore_forced_chunks += len(r.forced)
            self.stats.restore_from_earlier += r.from_before
            if r.failed:
                self.stats.last_error = f"restore of {path}: sources dropped: {r.failed}"
            if not ok:
                self.restores.pop(node.ino, None)
                if node.version == version:
                    self.copies.not_restoring(node)
        log.info("restored %s: %d bytes from %s, %s from peers%s", path, r.bucket_bytes,
                 tier.url, r.peer_bytes or 0, f" (dropped {r.failed})" if r.failed else "")
        return {**({tier.url: r.bucket_bytes} if r.bucket_bytes else {}), **r.peer_bytes}

    # -- fetching from holders -------------------------------------------------------

    def holders_of(self, node: Inode) -> list[Peer]:
        """Live peers holding this version that this host can reach (a host alive for
        the others but not answering this one's pings is not asked): the least busy
        first."""
        peers = [p for h in node.holders if h != self.node_id
                 for p in [self.members.by_node(h)] if p is not None and not p.unreachable]
        random.shuffle(peers)
        return sorted(peers, key=lambda p: p.busy)

    async def download(self, node: Inode, fd: int, on_verified: Callable[[int, int], None],
                       focus: Callable[[], int | None] = lambda: None) -> dict[str, int]:
        """Fill fd with the node's current version from its holders; each block is
        reported through on_verified (in this thread) once its crc32c matched.
        Returns the bytes each holder (node id) delivered; raises PeerFetchError when
        no holder could deliver it. Over the data channel, blocks come from every
        holder that offers one at once (striped); else from one holder at a time over
        gRPC, the next resuming where the last stopped."""
        if local_only(node):
            raise PeerFetchError(errno.EIO, f"larger than {MAX_SHARED_SIZE >> 40} TiB: kept "
                                 f"unchecksummed on {node.author or 'its writer'} only")
        version, size = node.version, node.size
        good = [0]  # bytes from offset 0 verified so far: the next holder resumes there
        errors = []
        peers = self.holders_of(node)
        if not peers:
            # A holder not heard from yet (it started a moment ago, or is back): its
            # broadcast reached us before our next health round; ask now.
            await self.members.check_all(wait=True)
            peers = self.holders_of(node)
        striping = [p for p in peers if self.channel.reaches(p)]
        if striping and size and node.block_crcs:
            delivered = [0]

            def counted(off: int, length: int) -> None:
                delivered[0] += length
                on_verified(off, length)

            failed: dict[str, BaseException] = {}  # holder -> why, on the data channel
            try:
                got = await self._striped(node, fd, striping, counted, failed, focus)
            except OSError as e:
                errors.append(f"data channel: {e}")
                if delivered[0]:
                    # gRPC writes a chunk before verifying it: it must not overwrite
                    # blocks readers were told are good. The caller moves on (bucket).
                    raise PeerFetchError(5, "no peer could deliver it (" + errors[0] + ")"
                                         ) from None
                # A holder that timed out on the data channel (stopped, or cut off) would
                # time out over gRPC too, and one that said it has no copy of this
                # version would say it again: only the others are asked again.
                stalled = {n for n, x in failed.items()
                           if isinstance(x, (TimeoutError, socket.timeout))}
                lacking = {n for n, x in failed.items()
                           if isinstance(x, Remote) and x.code in LACKS}
                for n in lacking:
                    self.copies.lacks(node, n, version)
                peers = [p for p in peers if p.node_id not in stalled | lacking]
                self.stats.error(f"fetching {self.ns.path_of(node)} over the data channel: {e}; "
                            "over gRPC instead" + (f" (not from {', '.join(sorted(stalled))}: "
                                                   "no answer)" if stalled else "")
                            + (f" (not from {', '.join(sorted(lacking))}: no copy there)"
                               if lacking else ""))
            else:
                self.stats.fetched_files += 1
                self.stats.fetched_bytes += size
                self.stats.bulk_fetched_bytes += size
                return got
        if not self.transfers.grpc_bytes:
            peers = []
            errors.append("peer encryption keeps file bytes off plain gRPC")
        for p in peers:
            try:
                await self._fetch_from(p, node, fd, version, size, good, on_verified)
            except (grpc.RpcError, IntegrityError, OSError) as e:
                self.stats.fetch_failures += 1
                if isinstance(e, IntegrityError):
                    self.stats.integrity_errors += 1
                why = (f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError)
                       else str(e))
                if isinstance(e, grpc.RpcError) and e.code().name in LACKS:
                    self.copies.lacks(node, p.node_id, version)
                errors.append(f"{p.node_id}: {why}")
                self.stats.error(f"fetching {self.ns.path_of(node)} from {p.node_id}: {why}")
                continue
            self.stats.fetched_files += 1
            self.stats.fetched_bytes += size
            return {p.node_id: size}
        raise PeerFetchError(5, "no peer could deliver it (" + ("; ".join(errors) or
                                                                 "no live holder") + ")")

    async def _striped(self, node: Inode, fd: int, holders: list[Peer],
                       on_verified: Callable[[int, int], None],
                       failed: dict[str, BaseException],
                       focus: Callable[[], int | None] = lambda: None) -> dict[str, int]:
        """Blocks from every holder at once (mtcfs.peer.striped), each verified (MAC and
        crc32c) before it is written and reported; returns bytes per holder."""
        channel = self.channel
        token = trio.lowlevel.current_trio_token()
        guid, version, size = node.guid, node.version, node.size
        path, crcs = self.ns.path_of(node), bytes(node.block_crcs or b"")
        blocks = block_count(size)

        def fetch(p: Peer, first: int, last: int, progress: Progress) -> None:
            def verified(off: int, length: int) -> None:
                progress.next = off // BLOCK + 1
                progress.bytes += length
                # Not waited for: the next block lands meanwhile. Callbacks run in the
                # order queued, and before this thread's end reaches the trio thread.
                token.run_sync_soon(on_verified, off, length)

            channel.fetch(p, fd, guid, version, path, size, crcs, first, last, verified)

        for p in holders:
            p.busy += 1
        def focus_block() -> int | None:
            at = focus()
            return None if at is None else at // BLOCK

        striped = Striped(fetch, blocks, channel.connections, self.transfers.bulk,
                          name=lambda p: p.node_id, focus=focus_block)
        try:
            by = await striped.run(holders)
        finally:
            failed.update(striped.errors)
            for p in holders:
                p.busy -= 1
            for name, e in striped.errors.items():
                self.stats.fetch_failures += 1
                if isinstance(e, IntegrityError):
                    self.stats.integrity_errors += 1
                self.stats.error(f"fetching {path} from {name} over the data channel: "
                            f"{type(e).__name__}: {e}")
        return by

    async def _fetch_from(self, p: Peer, node: Inode, fd: int, version: int, size: int,
                          good: list[int], on_verified: Callable[[int, int], None]) -> None:
        verify = BlockVerifier(size, node.crc32c or 0, node.block_crcs, start=good[0])
        token = trio.lowlevel.current_trio_token()
        prog = _Progress()
        req = pb.FetchRequest(id=node.guid, version=version, offset=verify.offset,
                              path=self.ns.path_of(node))

        def report(off: int, length: int) -> None:
            trio.from_thread.run_sync(on_verified, off, length, trio_token=token)

        def run() -> int:
            # wait_for_ready: a channel still backing off from before the peer was up
            # would fail at once; a peer that stays silent is cut by the watchdog.
            call = p.stub.FetchFile(req, timeout=60 + size / (20 << 20),
                                    metadata=self.members.metadata, wait_for_ready=True)
            prog.call = call
            for chunk in call:
                if chunk.offset != verify.offset:
                    raise IntegrityError(f"chunk at {chunk.offset}, expected {verify.offset}")
                data = chunk.data  # each access of a bytes field copies it
                os.pwrite(fd, data, chunk.offset)
                for off, length in verify.feed(data):
                    report(off, length)
                prog.tick()
            for off, length in verify.finish():
                report(off, length)
            return verify.offset

        p.busy += 1
        try:
            await self._watched(run, prog)
        finally:
            p.busy -= 1
            good[0] = verify.good

    async def _watched(self, fn: Callable[[], Any], prog: _Progress) -> Any:
        """Run a blocking transfer in a thread; cancel it when it stops making progress
        (a partitioned peer must not hang a reader or a replication)."""
        result: list[Any] = []
        failure: list[BaseException] = []

        async def run(cancel_scope: trio.CancelScope) -> None:
            try:
                result.append(await trio.to_thread.run_sync(fn, limiter=self.transfers.grpc))
            except Exception as e:  # re-raised below, not as an exception group
                failure.append(e)
            cancel_scope.cancel()

        async with trio.open_nursery() as n:
            n.start_soon(run, n.cancel_scope)
            while True:
                await trio.sleep(0.5)
                if time.monotonic() - prog.last > STALL_TIMEOUT and prog.call is not None:
                    prog.call.cancel()
                    prog.last = time.monotonic()
        if failure:
            raise failure[0]
        return result[0]

