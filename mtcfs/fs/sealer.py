"""The seal: what a file's writers wrote becomes a version (closed, with a crc32c
per file and per 4 MiB block) when its last writer closes it, on fsync, when a
closed file is truncated, and when a commit covers it.

Checksums stream as bytes are written in order, so most seals take no pass over
the data; a write out of order, a punched hole, or a writer the daemon does not
see (FUSE passthrough) leaves the seal one pass over the RAM file, off the event
loop. Writes, truncates and further opens may race with that pass: the rules for
each race are in `seal`, `closed` and `last_writer_gone`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import trio

from mtcfs.core.checksums import StreamingCrc, block_crcs_of_fd
from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, SEALING, Inode, Namespace
from mtcfs.core.steps import dirs_under
from mtcfs.core.versions import Versions, too_large_to_share
from mtcfs.tiers.ram import RamTier


@dataclass
class SealStats:
    seals: int = 0
    seal_full_passes: int = 0
    # Written through passthrough (the daemon sees none of it): counted at each seal
    # that makes a new version, as that version's size.
    bytes_written_passthrough: int = 0


class Sealer:
    """Seals files and keeps the checksum streams of files being written. Its
    collaborators: the namespace and the RAM tier, `copies` (a new version's one
    copy is here), `events` (sealed, resealed, rewriting) and `versions` (the one
    writer of a file's state, version and checksums)."""

    def __init__(self, ns: Namespace, ram: RamTier, copies: Copies, events: Listener,
                 versions: Versions) -> None:
        self.ns = ns
        self.ram = ram
        self.copies = copies
        self.events = events
        self.versions = versions
        self._crc: dict[int, StreamingCrc] = {}
        self._sealing: Counter[int] = Counter()  # inodes with a checksum pass in flight
        # Passthrough: the RAM file's (size, ctime) taken just before the checksum pass of
        # its last seal. tmpfs stamps ctime in fine grain once it was queried, so any write
        # after that stat changes it: an equal stamp means the sealed data is unchanged.
        self._seal_stamp: dict[int, tuple[int, int]] = {}
        self.stats = SealStats()

    # -- checksum streams --------------------------------------------------------------

    def created(self, node: Inode) -> None:
        """A new file: written from its start, its checksum streams from nothing."""
        node.dirty = True
        self._crc[node.ino] = StreamingCrc()

    def stream(self, node: Inode) -> StreamingCrc:
        crc = self._crc.get(node.ino)
        if crc is None:
            # The sealed checksum resumes only if it still describes the data: not once
            # a passthrough writer may have changed it unseen.
            resumable = (node.crc32c is not None and not node.pt_changed
                         and node.state != SEALING and node.size == node.sealed_size)
            crc = self._crc[node.ino] = (
                StreamingCrc(node.crc32c, node.size, blocks=node.block_crcs)
                if resumable
                else StreamingCrc(valid=False)
            )
        return crc

    def wrote(self, node: Inode, off: int, data: bytes) -> None:
        crc = self._crc.get(node.ino)
        if crc is not None:
            crc.update(off, data)

    def truncated(self, node: Inode, size: int) -> None:
        self.stream(node).truncate(size)

    def unstreamed(self, node: Inode) -> None:
        """Its bytes change where the daemon cannot follow (a passthrough writer): the
        seal takes a pass."""
        self._crc[node.ino] = StreamingCrc(valid=False)

    def punched(self, node: Inode, off: int) -> None:
        """A hole punched from `off`: streamed bytes there are zeros now."""
        crc = self._crc.get(node.ino)
        if crc is not None and crc.next_off > off:
            self.unstreamed(node)

    def writing(self, node: Inode) -> None:
        """First change to a sealed file: record it as open, so that a crash
        from here on leaves it marked incomplete rather than silently changed."""
        if node.dirty:
            return
        self.stream(node)
        node.dirty = True
        self.events.rewriting(node)
        if self.versions.writing(node):
            with self.ns.store.transaction():
                self.ns.persist(node)

    def forget(self, node: Inode) -> None:
        """The file's data is gone: its stream and seal stamp too."""
        self._crc.pop(node.ino, None)
        self._seal_stamp.pop(node.ino, None)

    def refresh(self, node: Inode) -> None:
        """A file written through passthrough: its size and mtime are the RAM file's
        (the daemon does not see those writes)."""
        if not (node.pt_writers or node.pt_changed or node.state == SEALING):
            return
        try:
            st = self.ram.stat(node.ino)
        except FileNotFoundError:
            return
        node.size = st.st_size
        if st.st_mtime_ns != node.ram_mtime_ns:  # written since: (else kept, e.g. utimensat)
            node.ram_mtime_ns = st.st_mtime_ns
            node.mtime_ns = node.ctime_ns = st.st_mtime_ns
        self.ram.reconcile(node.ino)

    # -- when a seal happens -------------------------------------------------------------

    async def before_writer(self, node: Inode) -> None:
        """A writer opens the file."""
        if node.state == SEALING:
            # Its last writer closed it (through passthrough) and its checksum is not
            # taken yet (the release may still be on its way): what it wrote is a
            # version of its own, sealed before this writer may change it.
            await self.seal(node)

    async def closed(self, node: Inode, through_passthrough: bool, visible: bool) -> None:
        """close() of a writer: seal now if it is the last one, so close() returns only
        once the file's state and crc32c are recorded. A file written through
        passthrough is sealed when its last handle is released (a shared writable
        mapping may outlive close()): close() marks it `sealing` and returns at once,
        unless it must be `visible` now."""
        # With passthrough the daemon does not see writes: a file a passthrough writer
        # had open counts as written (its checksum tells whether it changed).
        # Fsynced, then closed without a write since: that seal stands (the release,
        # after any mapping is gone, checksums it once more, off the close() path).
        unchanged = through_passthrough and not node.dirty and self._unchanged_since_seal(node)
        if node.writers > 1 or unchanged:
            return
        if not (node.dirty or (through_passthrough and node.pt_changed)):
            return
        if through_passthrough and not visible:
            self.refresh(node)
            if self.versions.closing(node):
                with self.ns.store.transaction():
                    self.ns.persist(node)
        else:
            await self.seal(node)

    async def fsynced(self, node: Inode) -> bool:
        """fsync(): seal what was written so far as a version others can see. Returns
        whether that seal stands (False: written during its pass; the next fsync or
        close seals it)."""
        if node.dirty or node.state == SEALING or node.pt_changed:
            # (pt_changed: reopened and perhaps written through passthrough, which the
            # daemon does not see: the seal takes the RAM file as it is, a new version
            # only if its bytes changed.)
            return await self.seal(node) and not node.dirty
        return True

    async def resealed_closed(self, node: Inode) -> None:
        """A closed file changed without a writer (truncate(2)): seal it again."""
        if node.writers == 0 and (node.dirty or node.state == SEALING or node.pt_changed):
            await self.seal(node)

    async def last_writer_gone(self, node: Inode) -> None:
        """A writer's handle was released (with it any mapping)."""
        if node.writers == 0 and (node.dirty or node.state == SEALING or node.pt_changed):
            # The last writer is gone: the final checksum.
            await self.seal(node)
            # Still "written through passthrough" while anyone writes: a writer that
            # opened during the seal's pass (the seal then left it to the last
            # release) must find it so, or its close would seal nothing.
            node.pt_changed = node.pt_changed and node.writers > 0

    def handle_gone(self, node: Inode) -> None:
        """A handle was released: with the last one, its stream goes (a seal's pass in
        flight keeps it) and an fsync no longer holds for a later close."""
        if node.opens == 0 and not self.in_pass(node):
            self.forget(node)
            node.fsynced = False

    async def settle(self, node: Inode) -> None:
        """Seal now what is `sealing` at or below `node` (closed through passthrough,
        its checksum not taken yet): a commit or a directory fsync covers it."""
        if node.is_dir:
            files = [self.ns.inodes[i] for i in (node.children or {}).values()]
            files += [f for d in dirs_under(self.ns, node) for f in
                      (self.ns.inodes[i] for i in (d.children or {}).values())]
        else:
            files = [node]
        for f in files:
            if f.is_file and f.state == SEALING and not f.writers:
                await self.seal(f)

    def in_pass(self, node: Inode) -> bool:
        """A seal's checksum pass over the file's data is in flight."""
        return node.ino in self._sealing

    @contextlib.asynccontextmanager
    async def shrinking(self, node: Inode) -> AsyncIterator[None]:
        """Around a shrink of the file's RAM file or a hole punched in it: waits until
        no checksum pass or transfer reads the file through a mapping (where a page
        past the end is SIGBUS and a hole touched is a page allocated; a pass takes
        about 40 ms per GiB), and those that start meanwhile read it
        (mtcfs.tiers.mapped)."""
        async with self.ram.mapped.shrinking(node.ino):
            yield

    def _unchanged_since_seal(self, node: Inode) -> bool:
        stamp = self._seal_stamp.get(node.ino)
        if stamp is None or node.state != CLOSED:
            return False
        try:
            st = self.ram.stat(node.ino)
        except FileNotFoundError:
            return False
        return (st.st_size, st.st_ctime_ns) == stamp

    # -- the seal ------------------------------------------------------------------------

    async def seal(self, node: Inode) -> bool:
        """Take the file's checksum and seal it as a version. False: not sealed (written
        during the pass: a later release or fsync seals it; or gone)."""
        if not node.linked:
            node.dirty = False
            return False
        stamp = None
        through_passthrough, version = node.pt_changed, node.version
        if node.pt_changed:
            self.refresh(node)  # written through passthrough: the RAM file says how big
            self.unstreamed(node)
            stamp = self._stamp(node)  # before the pass: a later write changes it
        if too_large_to_share(node.size):
            # Kept here only, as tmpfs keeps it: no checksums (mtcfs.core.versions).
            self._crc.pop(node.ino, None)
            self._seal_stamp.pop(node.ino, None)
            self._seal_now(node, None, None)
            return True
        stream = self.stream(node)
        crc, blocks = stream.result(node.size), stream.blocks(node.size)
        while crc is None or blocks is None:
            # Written out of order: one pass over the data, off the event loop.
            seq, size = node.wseq, node.size
            self.stats.seal_full_passes += 1
            fd = self.ram.acquire(node.ino)
            self._sealing[node.ino] += 1
            # Mapped where huge pages back the tier (38 % less CPU; with small pages,
            # faulting them in costs more than reading): the pin keeps the file from
            # shrinking or having a hole punched in it meanwhile (shrinking).
            pin = self.ram.mapped.pin(node.ino)
            try:
                crc, blocks = await trio.to_thread.run_sync(
                    partial(block_crcs_of_fd, fd, size, mapped=pin.mapped))
            finally:
                pin.release()
                self._sealing[node.ino] -= 1
                if not self._sealing[node.ino]:
                    del self._sealing[node.ino]
                self.ram.release(node.ino)
            if not node.linked:
                return False
            if node.wseq != seq or node.size != size or self._moved(node, stamp):
                if node.writers:
                    return False  # written during the pass: the last release seals again
                # Truncated (or written and closed) during the pass, nobody writing
                # now: no release will come to seal it, so take it again.
                if stamp is not None:
                    self.refresh(node)
                    stamp = self._stamp(node)
                stream = self.stream(node)
                crc, blocks = stream.result(node.size), stream.blocks(node.size)
                if crc is None or blocks is None:
                    continue
                break
            self._crc[node.ino] = StreamingCrc(crc, node.size, blocks=blocks)
        self._seal_now(node, crc, blocks)
        if through_passthrough and node.version != version:
            self.stats.bytes_written_passthrough += node.size
        if stamp is not None and stamp[0] == node.size:
            self._seal_stamp[node.ino] = stamp
        else:
            self._seal_stamp.pop(node.ino, None)
        return True

    def _stamp(self, node: Inode) -> tuple[int, int] | None:
        try:
            st = self.ram.stat(node.ino)
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_ctime_ns)

    def _moved(self, node: Inode, stamp: tuple[int, int] | None) -> bool:
        """Written through passthrough during the pass (the daemon saw no write: the
        RAM file's size or ctime tell)."""
        return stamp is not None and self._stamp(node) != stamp

    def seal_empty(self, node: Inode) -> None:
        """A regular file made by mknod: sealed empty at once."""
        self._seal_now(node, 0, b"")

    def _seal_now(self, node: Inode, crc: int | None, blocks: bytes | None) -> None:
        node.dirty = False
        if self.versions.sealed(node, crc, blocks):
            self.copies.sealed_here(node)
            new = True
        else:
            new = False  # a write-open that changed nothing: its copies stay good
        self.ram.reconcile(node.ino)
        with self.ns.store.transaction():
            self.ns.persist(node)
        self.stats.seals += 1
        if new:
            self.events.sealed(node)
        else:
            self.events.resealed(node)
