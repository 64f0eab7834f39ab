"""The uploader: persists sealed files to the durable tier in the background.

- Never blocks write() or close(): the filesystem only notifies it; uploads run
  in worker threads with bounded concurrency.
- Commit ordering (markers.py): a commit marker is uploaded only after every other
  file of its step directory is persisted, and while every host is alive and
  caught up with, or gone for good.
- Nothing under a temporary name is uploaded (it will be, under its final name,
  once renamed). A rename of persisted data ends with every file under its new
  name in the bucket: the renaming host copies each object server-side
  (server_copies.py) and deletes the old object only once the copy is there; files
  not yet persisted are uploaded under the new name by their writer. Deleted
  files' objects are deleted (deletes.py, generation precondition); pending copies
  and deletions survive a restart.
- A hard-linked file is stored once per name (GCS has no links): its writer
  copies the object to each further name and keeps them in step.
- Retries forever with exponential backoff while the tier is unreachable: the
  data stays in RAM meanwhile. A generation precondition makes sure a stale
  node cannot overwrite a newer object.
- What lands is recorded and announced by `Copies.persisted`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.core.checksums import (
    CHUNK_META_KEY,
    chunk_crcs_from_blocks,
    chunk_crcs_of_fd,
    crc_of_chunks,
    encode_chunk_meta,
)
from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.core.steps import StepRules, all_steps, dirs_under, files_under, newest_complete_step
from mtcfs.core.versions import MAX_SHARED_SIZE, local_only
from mtcfs.persist.attempts import Backoff, Stats
from mtcfs.persist.deletes import Deletes
from mtcfs.persist.markers import Links, Markers, temporary_below
from mtcfs.persist.policy import Mode, PersistPolicy
from mtcfs.persist.requests import Requested
from mtcfs.persist.server_copies import CopyJob, ServerCopies, writes
from mtcfs.tiers.durable import (
    DurableError,
    DurableTier,
    IntegrityError,
    PreconditionFailed,
    Unavailable,
)

if TYPE_CHECKING:
    from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

# A host that sees another host rename persisted data leaves the copies to it this long
# before it uploads its own files under the new name itself.
COPY_GRACE = 60.0

__all__ = ["COPY_GRACE", "CopyJob", "Stats", "Uploader"]


class FileChangedError(Exception):
    pass


def put_object(ram: RamTier, tier: DurableTier, ino: int, key: str, crc: int, size: int,
               gen: int, blocks: bytes | None, progress: Callable[[int, int], None]) -> Any:
    """Upload one sealed file's RAM copy (in a worker thread), its chunk crcs beside;
    FileChangedError if its data no longer matches its seal."""
    if blocks is not None:  # the chunks' crcs follow from the blocks': no pass
        chunk, crcs = chunk_crcs_from_blocks(blocks, size)
    else:  # sealed before per-block crcs were kept: one pass
        fd = ram.open_read(ino)
        try:
            chunk, crcs = chunk_crcs_of_fd(fd, size)
        finally:
            os.close(fd)
        if crc_of_chunks(chunk, crcs, size) != crc:
            raise FileChangedError(key)
    try:
        return tier.put_file(key, ram.path(ino), crc, if_generation_match=gen,
                             progress=progress,
                             metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)})
    except IntegrityError:
        # The data changed since the seal (rewritten in place): the upload is refused
        # by its checksum; the next seal queues the new version.
        raise FileChangedError(key) from None


class Uploader(Listener):
    """The upload queue and its workers. Its parts: `deletes` (objects to delete,
    markers first), `server_copies` (renames and hard links' further names), `markers`
    (which commit markers may go). `stats` is the tier's `on_retry` recorder too."""

    def __init__(self, ns: Namespace, ram: RamTier, tier: DurableTier, policy: PersistPolicy,
                 rules: StepRules, copies: Copies, events: Listener,
                 node_id: str = "", concurrency: int = 4,
                 hosts_accounted: Callable[[], bool] = lambda: True,
                 stats: Stats | None = None) -> None:
        """`hosts_accounted()`: every host of the job is alive or gone for good (a
        marker waits meanwhile: a host cut off may hold files of its step unseen)."""
        self.ns = ns
        self.ram = ram
        self.tier = tier
        self.copies = copies  # records and announces what landed
        # copy_wanted: the fetcher brings another host's file here (`mtcfs persist` of a
        # file this host did not write and holds no copy of).
        self.events = events
        # With peers, each host uploads the files it wrote; the others learn that a file
        # is persisted from the index. Without peers (""), this host owns every file.
        self.node_id = node_id
        self.policy = policy
        self.rules = rules
        self.concurrency = concurrency
        self.queue: dict[int, Inode] = {}  # insertion-ordered: FIFO
        self.inflight: dict[int, Inode] = {}
        self.failed: dict[int, str] = {}  # conflicts that need a person, and lost files
        # No host could supply these (a fetch failed): out of the queue until a copy may
        # be back (fetched here, the file's entry changed, a host back): see _found.
        self.lost: dict[int, Inode] = {}
        self._uploading: dict[int, str] = {}  # ino -> key, uploads running now
        self.requested = Requested(ns.store)  # by `mtcfs persist`
        self.stats = stats or Stats()
        self.backoff = Backoff(self.stats)
        self._lot = trio.lowlevel.ParkingLot()
        limiter = trio.CapacityLimiter(concurrency)
        self._limiter = limiter
        self.deletes = Deletes(ns, tier, rules, self.backoff, limiter, self._lot)
        self.links = Links(ns)
        self.markers = Markers(ns, rules, self.links, hosts_accounted)
        self.server_copies = ServerCopies(ns, tier, copies, self.deletes, self.markers,
                                          self.backoff, limiter, self._lot, node_id)

    @property
    def url(self) -> str:
        return self.tier.url

    @property
    def pending_deletes(self) -> dict[str, int]:
        """Objects this host is deleting (a listing does not merge them back)."""
        return self.deletes.pending

    def persists(self, node: Inode) -> bool:  # ever uploaded: not under a temporary name
        return not self.rules.is_temporary(self.ns, node)

    # -- notifications from the filesystem (never block) -------------------------

    def sealed(self, node: Inode) -> None:
        self._found(node)
        if node.ino in self.requested:
            self._enqueue(node)  # asked for by `mtcfs persist`: also after a rewrite/rename
        if self.policy.mode is Mode.ON_CLOSE:
            if not self.rules.is_temporary(self.ns, node):
                self._enqueue(node)
        elif self.policy.mode is Mode.STEP:
            if self.rules.is_marker_name(node.name):
                parent = self.ns.inodes[node.parent]
                if self.rules.is_committed_step(self.ns, parent):
                    self.commit_step(parent)
                    return
            step = self.rules.enclosing_step(self.ns, node)
            if step is not None and not self.rules.is_temporary(self.ns, node):
                self._enqueue(node)  # a file added to an already committed step

    def renamed(self, node: Inode, old_path: str) -> None:
        """`node` (a file or a directory) was moved from `old_path` by this host.
        Persisted files are copied to their new names server-side, old objects
        deleted only once the copy is there; the others are uploaded per policy."""
        new_path = self.ns.path_of(node)
        if node.is_file and new_path == old_path:
            self.sync_links(node)  # one of a hard-linked file's further names moved
            return
        files = [node] if node.is_file else list(files_under(self.ns, node)) if node.is_dir else []
        with self.ns.store.transaction():
            for f in files:
                if not f.generation:
                    continue
                old_key = old_path + self.ns.path_of(f)[len(new_path):]
                if f.persisted and not self.rules.is_temporary(self.ns, f):
                    self.server_copies.add(CopyJob(f.ino, self.ns.path_of(f), old_key, f.generation,
                                           f.version, move=True))
                else:
                    self.deletes.later(old_key, f.generation)
                self.copies.unpersisted(f)
            self.server_copies.save()
        for f in files:
            if f.state == CLOSED and not self.server_copies.move_pending(f):
                self.sealed(f)
            self.sync_links(f)
        if node.is_dir and self.policy.mode is Mode.STEP:
            for d in [node, *dirs_under(self.ns, node)]:
                if self.rules.is_committed_step(self.ns, d):
                    self.commit_step(d)
        self._lot.unpark_all()

    def remote_moved(self, node: Inode, old_path: str) -> None:
        """Another host moved `node` from `old_path`: its files are persisted under their
        new names once that host's copies land, which it announces. This host moves
        the objects it uploaded too (the mover may not have heard of one yet: left
        under its old name, a listing brings it back); a second copy is harmless."""
        files = [node] if node.is_file else list(files_under(self.ns, node)) if node.is_dir else []
        new_path = self.ns.path_of(node)
        deadline = time.monotonic() + COPY_GRACE
        with self.ns.store.transaction():
            for f in (f for f in files if f.generation):
                path = self.ns.path_of(f)
                if f.persisted and self.owns(f) and not self.rules.is_temporary(self.ns, f):
                    self.server_copies.add(CopyJob(f.ino, path, old_path + path[len(new_path):],
                                                   f.generation, f.version, move=True))
                self.copies.unpersisted(f)
                f.copy_grace = deadline
            self.server_copies.save()
        # Never uploaded (a temporary name, or not yet): the mover has no object to copy
        # and, without the data, does not upload; the host that sealed it does.
        for f in files:
            if not f.generation and f.state == CLOSED and self.owns(f):
                self.sealed(f)

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        """A hard-linked file lost the name at `path` (it keeps others)."""
        objs = self.links.objects.get(node.ino, {})
        with self.ns.store.transaction():
            if was_own and node.generation:
                # The file is now known by its oldest further name: that object, if in
                # step, becomes the file's own; the old name's object goes.
                self.deletes.later(path, node.generation)
                adopted = objs.pop(self.ns.path_of(node), None)
                if adopted is not None and adopted[1] == node.version:
                    self.copies.object_adopted(node, adopted[0])
                else:
                    if adopted is not None:
                        self.deletes.later(self.ns.path_of(node), adopted[0])
                    self.copies.unpersisted(node)
            elif not was_own and path in objs:
                self.deletes.later(path, objs.pop(path)[0])
            self.links.save()
        if not node.persisted and node.state == CLOSED:
            self.sealed(node)
        self.sync_links(node)

    def resealed(self, node: Inode) -> None:
        """Sealed again unchanged: queued again if it was not persisted yet."""
        self.sealed(node)

    def linked(self, node: Inode) -> None:
        self.sync_links(node)

    def sync_links(self, node: Inode) -> None:
        self.server_copies.sync_links(node)

    def removed(self, node: Inode, path: str) -> None:
        """A file was unlinked (or replaced by a rename) at `path`: its last name."""
        if not node.is_file:
            return
        self.queue.pop(node.ino, None)
        self.failed.pop(node.ino, None)
        self.lost.pop(node.ino, None)
        self.requested.discard(node.ino)
        with self.ns.store.transaction():
            if node.generation:
                self.deletes.later(path, node.generation)
            self.copies.name_gone(node)
            self.server_copies.forget(node)

    def rewriting(self, node: Inode) -> None:
        """A sealed file is being written again: its queued upload waits for the seal."""
        self.queue.pop(node.ino, None)

    # -- requests ----------------------------------------------------------------------

    def commit_step(self, d: Inode) -> int:
        # Not files under temporary names: they are uploaded once renamed into place.
        files = [f for f in files_under(self.ns, d)
                 if f.state == CLOSED and not temporary_below(self.ns, self.rules, f, d)]
        # Markers last: FIFO order plus the marker gate below.
        files.sort(key=lambda f: self.rules.is_marker_name(f.name))
        for f in files:
            self._enqueue(f)
        return len(files)

    def request(self, nodes: list[Inode]) -> tuple[int, int]:
        """`mtcfs persist`: persist these files now, whatever the policy."""
        files = sorted((n for n in nodes if n.is_file and n.state == CLOSED),
                       key=lambda f: self.rules.is_marker_name(f.name))
        self.requested.add(f.ino for f in files if not f.persisted)
        for f in files:
            self._found(f)
            self._enqueue(f)
        return len(files), sum(f.size for f in files)

    def owns(self, node: Inode) -> bool:
        """This host uploads the files it sealed (all of them without peers), whoever
        renamed them since."""
        return writes(self.node_id, node)

    def peers_changed(self) -> None:
        """A host came back (or went): a marker held for it may go, a lost copy be back."""
        for node in list(self.lost.values()):
            self._found(node)
        if self.markers.waiting_for_hosts:
            self._lot.unpark_all()

    def _found(self, node: Inode) -> None:
        self.failed.pop(node.ino, None)
        if self.lost.pop(node.ino, None) is not None:
            self._enqueue(node)

    def remote_changed(self, nodes: list[Inode]) -> None:
        """Changes from other hosts: a step they committed (a marker, a directory
        renamed into place) commits our files in it too; a file they persisted may
        be the last one a marker here waits for."""
        for n in nodes:
            if n.is_file and (n.links or n.ino in self.links.objects):
                self.sync_links(n)
            if n.ino in self.lost:
                self._found(n)  # its holders changed
        if self.policy.mode is Mode.STEP:
            for n in nodes:
                if not n.linked:
                    continue
                if n.is_file and self.rules.is_marker_name(n.name):
                    parent = self.ns.inodes[n.parent]
                    if self.rules.is_committed_step(self.ns, parent):
                        self.commit_step(parent)
                elif n.is_dir:
                    for d in [n, *dirs_under(self.ns, n)]:
                        if self.rules.is_committed_step(self.ns, d):
                            self.commit_step(d)
        self._lot.unpark_all()

    def _enqueue(self, node: Inode) -> None:
        # A file already in flight is queued again: it was renamed or rewritten
        # since its upload started, and must be uploaded (again) once that ends.
        # `mtcfs persist` may name other hosts' files: this host uploads those too
        # (from its copy, fetched first if need be; see _next_job).
        if node.persisted or not (self.owns(node) or node.ino in self.requested):
            return
        if local_only(node):
            log.warning("not uploading %s: larger than %d TiB, it is kept on this host only",
                        self.ns.path_of(node), MAX_SHARED_SIZE >> 40)
            return
        self.queue[node.ino] = node
        self._lot.unpark_all()

    def wake(self) -> None:
        self._lot.unpark_all()

    def _fetch_then_upload(self, node: Inode) -> None:
        """`mtcfs persist` of another host's file this host holds no copy of: fetch it
        first (`fetched` wakes the workers)."""
        if node.ino not in self.failed:
            self.events.copy_wanted(node)

    def fetched(self, node: Inode) -> None:
        self._found(node)
        if node.ino in self.queue:
            self._lot.unpark_all()

    def fetch_failed(self, node: Inode, why: str) -> None:
        if (node.ino in self.requested or self.owns(node)) and node.ino in self.queue:
            self.failed[node.ino] = f"no copy could be fetched: {why}"  # (mtcfs persist)
            self.lost[node.ino] = self.queue.pop(node.ino)
            log.error("cannot persist %s: no copy could be fetched: %s",
                      self.ns.path_of(node) if node.linked else node.guid, why)

    # -- status ----------------------------------------------------------------------

    def pending_bytes(self) -> int:
        return sum(n.size for ino, n in self.queue.items() if ino not in self.inflight) + sum(
            n.size for n in self.inflight.values()) - self.stats.inflight_bytes_done

    def status(self) -> dict[str, Any]:
        return {
            "url": self.tier.url,
            "policy": str(self.policy),
            "queued_files": sum(1 for ino in self.queue if ino not in self.inflight),
            "inflight_files": len(self.inflight),
            "pending_bytes": max(0, self.pending_bytes()),
            "pending_deletes": len(self.deletes.pending),
            "pending_copies": len(self.server_copies.jobs),
            "copied_objects": self.stats.copies,
            "uploaded_files": self.stats.files_uploaded,
            "uploaded_bytes": self.stats.bytes_uploaded,
            "deleted_objects": self.stats.deletes,
            "errors": self.stats.errors,
            "conflicts": len(self.failed) - len(self.lost),
            "lost_files": len(self.lost),
            "last_error": self.stats.last_error or None,
            "last_error_age": (round(time.time() - self.stats.last_error_time, 1)
                               if self.stats.last_error else None),
            "retrying_in": round(self.backoff.delay, 1) if self.backoff.delay else 0,
            "last_upload_age": (round(time.time() - self.stats.last_upload_time, 1)
                                if self.stats.last_upload_time else None),
            "markers_held": self.markers.status(self.queue),
        }

    def idle(self) -> bool:
        return (not self.queue and not self.inflight and not self.deletes.pending
                and not self.server_copies.jobs)

    def busy(self, node: Inode) -> bool:
        """Being uploaded now: its RAM copy is being read."""
        return node.ino in self.inflight

    def settling(self) -> bool:
        """Uploads pending: they make data evictable."""
        return not self.idle()

    # -- the work ----------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(self._worker)
            if self.policy.mode is Mode.INTERVAL:
                nursery.start_soon(self._interval_loop)
            self._requeue_unpersisted()

    def _requeue_unpersisted(self) -> None:
        """After a restart: redo what the policy wanted persisted but was not."""
        for ino in self.requested:
            node = self.ns.get(ino)
            if node is None or not node.is_file or not node.linked:
                self.requested.discard(ino)
            elif node.state == CLOSED:
                self._enqueue(node)
        if self.policy.mode is Mode.ON_CLOSE:
            for f in self.ns.files():
                if f.state == CLOSED and f.linked and not self.rules.is_temporary(self.ns, f):
                    self._enqueue(f)
        elif self.policy.mode is Mode.STEP:
            for d in all_steps(self.ns, self.rules):
                if self.rules.is_committed_step(self.ns, d):
                    self.commit_step(d)

    async def _interval_loop(self) -> None:
        while True:
            await trio.sleep(self.policy.interval)
            newest = newest_complete_step(self.ns, self.rules)
            if newest is not None:
                self.commit_step(newest)

    def _next_job(self) -> Inode | None:
        self.markers.forget_unqueued(self.queue)
        for ino, node in list(self.queue.items()):
            if not node.linked or node.state != CLOSED or node.persisted or local_only(node):
                del self.queue[ino]
                continue
            if not node.has_data:
                # Ours but not here (this host replaced its lost predecessor, whose
                # copy survives on a peer), or asked for by `mtcfs persist`: the data is
                # fetched first, then uploaded.
                if self.owns(node) or node.ino in self.requested:
                    self._fetch_then_upload(node)
                continue
            if node.dirty:
                # Being rewritten: the next seal queues it again. (A writer that is
                # still open but wrote nothing since the seal does not hold it back:
                # close() seals in flush(), before release(), and nothing would
                # wake the workers once release() drops the last writer.)
                continue
            if ino in self.inflight:
                continue  # queued again while uploading: once that upload ends
            if self.server_copies.move_pending(node) or node.copy_grace > time.monotonic():
                continue  # a server-side copy brings it under its new name
            if self.rules.is_marker_name(node.name) and not self.markers.may_go(node):
                continue
            if (self.deletes.busy() or self._uploading) and self._delete_pending(node):
                # The old object at this key (a file replaced by rename, or removed
                # and created again) goes first; the new one is put "if absent".
                continue
            del self.queue[ino]
            return node
        return None

    def _delete_pending(self, node: Inode) -> bool:
        key = self.ns.path_of(node)
        # An upload to this key still running belongs to a file replaced since: its
        # object is deleted once that upload ends.
        return self.deletes.blocks(key) or key in self._uploading.values()

    async def _worker(self) -> None:
        while True:
            if self.backoff.delay:
                await trio.sleep(self.backoff.delay)
            copy = self.server_copies.next()
            if copy is not None:
                instead = await self.server_copies.run(copy)
                if instead is not None:
                    self.sealed(instead)  # the copy is moot: uploaded per policy instead
                continue
            job = self.deletes.next()
            if job is not None:
                await self.deletes.run(*job)
                continue
            self.markers.looking_again()
            node = self._next_job()
            if node is None:
                with trio.move_on_after(self.markers.park_for()):
                    await self._lot.park()
                continue
            self.inflight[node.ino] = node
            self._uploading[node.ino] = self.ns.path_of(node)
            try:
                await self._upload(node)
            finally:
                self.inflight.pop(node.ino, None)
                self._uploading.pop(node.ino, None)
                self._lot.unpark_all()  # a marker may be ready now

    async def _upload(self, node: Inode) -> None:
        key = self.ns.path_of(node)
        version, crc, size, gen = node.version, node.crc32c, node.size, node.generation
        blocks = node.block_crcs
        assert crc is not None
        done = 0

        def progress(offset: int, length: int) -> None:
            nonlocal done
            done += length
            self.stats.inflight_bytes_done += length

        t0 = time.monotonic()
        try:
            try:
                info = await trio.to_thread.run_sync(partial(
                    put_object, self.ram, self.tier, node.ino, key, crc, size, gen, blocks,
                    progress), limiter=self._limiter, abandon_on_cancel=True)
            except PreconditionFailed:
                info = await trio.to_thread.run_sync(self.tier.stat, key,
                                                     abandon_on_cancel=True)
                if info is None or info.crc32c != crc or info.size != size:
                    msg = (f"conflict: object {key} in {self.tier.url} was changed by someone "
                           f"else since this node last saw it; not overwriting (rename or "
                           f"remove the local file)")
                    log.error("%s", msg)
                    self.failed[node.ino] = msg
                    self.stats.conflicts += 1
                    self.stats.record_error(msg)
                    return
                # Our own earlier upload landed (e.g. before a crash): adopt it.
        except (FileNotFoundError, FileChangedError):
            if node.linked and node.state == CLOSED and not node.dirty and not node.has_data:
                # Not removed nor changed: its data left this host's RAM (lost with
                # the RAM dir). Nothing here can upload it: say so, never silently.
                msg = f"cannot persist {key}: its data is no longer in this host's RAM"
                self.stats.record_error(msg)
                log.error("%s", msg)
            return  # removed, or changed since its seal: its next seal queues it again
        except ValueError as e:
            # A name the durable tier cannot store (e.g. a newline in it): retrying
            # cannot help, and it must not take the uploader (and the mount) down.
            msg = f"cannot persist {key!r}: {e}"
            log.error("%s", msg)
            self.failed[node.ino] = msg
            self.stats.record_error(msg)
            return
        except (Unavailable, DurableError, OSError) as e:
            if not node.linked:
                return  # removed meanwhile (its RAM data may be gone): nothing to do
            self._enqueue_front(node)
            self.backoff.failed(f"upload {key}: {e}")
            return
        finally:
            self.stats.inflight_bytes_done -= done
        self.backoff.succeeded()
        self.stats.files_uploaded += 1
        self.stats.bytes_uploaded += size
        self.stats.last_upload_time = time.time()
        still_here = node.linked and self.ns.path_of(node) == key
        log.info("persisted %s (%d bytes, generation %d) in %.2f s", key, size, info.generation,
                 time.monotonic() - t0)
        if still_here:
            if node.version == version:
                self.requested.discard(node.ino)
            self.copies.persisted(node, info.generation, version)  # recorded and announced
            self.sync_links(node)
        else:
            # Renamed or removed while uploading: that object is stale.
            with self.ns.store.transaction():
                self.deletes.later(key, info.generation)
            if node.linked and node.state == CLOSED:
                self.sealed(node)  # renamed while uploading: upload it under its new name
        if still_here and node.version != version:
            self.sealed(node)

    def _enqueue_front(self, node: Inode) -> None:
        rest = dict(self.queue)
        self.queue = {node.ino: node, **rest}
