"""Server-side copies in the durable tier (GCS rewrite: no data through any host):
a renamed file's object to its new name, and a hard-linked file's object to each
further name (GCS has no links). Pending copies and the further names' objects are
kept in the metadata store; a copy's source object is deleted only once the copy
is there."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial

import trio

from mtcfs.core.copies import Copies
from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.persist.attempts import Backoff
from mtcfs.persist.deletes import Deletes
from mtcfs.persist.markers import Markers
from mtcfs.tiers.durable import (
    DurableError,
    DurableTier,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Unavailable,
)

log = logging.getLogger("mtcfs.persist.uploader")

COPIES_KEY = "pending_copies"  # metadata store: server-side copies still to do


@dataclass
class CopyJob:
    """A server-side copy: `src` (exactly generation `src_gen`) to the file's name
    `dst`. `move`: the source object goes once the copy is there (a rename);
    otherwise it stays (the further name of a hard link)."""

    ino: int
    dst: str
    src: str
    src_gen: int
    version: int
    move: bool
    dst_gen: int = 0  # the destination's expected live generation (0: absent)

    def key(self) -> tuple[int, str]:
        return self.ino, self.dst


def writes(node_id: str, node: Inode) -> bool:
    """This host uploads the files it sealed (all of them without peers, node_id ""),
    whoever renamed them since."""
    return not node_id or not node.author or node.author == node_id


class ServerCopies:
    """Pending server-side copies (`jobs`), and the objects of hard links' further
    names (`links`, kept by Markers' view of them). `wake` is unparked when a copy is
    added or ends."""

    def __init__(self, ns: Namespace, tier: DurableTier, copies: Copies, deletes: Deletes,
                 markers: Markers, backoff: Backoff, limiter: trio.CapacityLimiter,
                 wake: trio.lowlevel.ParkingLot, node_id: str = "") -> None:
        self.ns = ns
        self.tier = tier
        self.copies = copies
        self.deletes = deletes
        self.markers = markers
        self.links = markers.links
        self.backoff = backoff
        self.limiter = limiter
        self.wake = wake
        self.node_id = node_id
        self.jobs: dict[tuple[int, str], CopyJob] = {}
        self.running: set[tuple[int, str]] = set()
        for job in json.loads(ns.store.get_meta(COPIES_KEY) or "[]"):
            self.add(CopyJob(**job))

    def add(self, job: CopyJob) -> None:
        self.jobs[job.key()] = job
        if job.move and self.deletes.is_marker_key(job.src):
            self.deletes.hold(job.src)  # its directory's other objects go after it

    def move_pending(self, node: Inode) -> bool:
        """A copy brings this file under its new name (it is not uploaded meanwhile)."""
        return any(ino == node.ino and j.move for (ino, _), j in self.jobs.items())

    def old_object_found(self, node: Inode, obj: ObjectInfo) -> None:
        """The bucket listing found renamed `node`'s object under its old name: a
        move its mover's copy should have made. Its writer makes it (again: the
        mover's pending copy may have died with it, a host replaced by an empty one;
        a second copy of a move still running is harmless)."""
        if node.persisted or not writes(self.node_id, node) or self.move_pending(node):
            return  # (the listing matched obj to node by size and crc32c)
        path = self.ns.path_of(node)
        with self.ns.store.transaction():
            self.add(CopyJob(node.ino, path, obj.key, obj.generation, node.version, move=True))
            self.save()
        log.warning("%s: its object is still under its old name %s: moving it", path, obj.key)
        self.wake.unpark_all()

    def save(self) -> None:
        self.ns.store.set_meta(COPIES_KEY, json.dumps([vars(j) for j in self.jobs.values()]))

    def forget(self, node: Inode) -> None:
        """The file's last name went: its copies are moot, a move's source goes too,
        and so do its further names' objects (in the caller's transaction)."""
        for key in [k for k in self.jobs if k[0] == node.ino]:
            job = self.jobs.pop(key)
            if job.move:
                self.deletes.later(job.src, job.src_gen)
        for key, (gen, _) in self.links.objects.pop(node.ino, {}).items():
            self.deletes.later(key, gen)
        self.save()
        self.links.save()

    def sync_links(self, node: Inode) -> None:
        """Bring the objects of a hard-linked file's further names in line with its
        names and its persisted version (this host's files only)."""
        objs = self.links.objects.get(node.ino)
        if not node.links and not objs:
            return
        if not writes(self.node_id, node):
            return
        objs = self.links.objects.setdefault(node.ino, {})
        want = set(self.ns.link_paths(node)) if node.linked else set()
        changed = False
        with self.ns.store.transaction():
            for key in [k for k in objs if k not in want]:
                self.deletes.later(key, objs.pop(key)[0])
                changed = True
            if node.persisted:
                for key in sorted(want):
                    have = objs.get(key)
                    if have is None or have[1] != node.version:
                        self.add(CopyJob(node.ino, key, self.ns.path_of(node),
                                         node.generation, node.version, move=False,
                                         dst_gen=have[0] if have else 0))
                        changed = True
            if not objs:
                self.links.objects.pop(node.ino, None)
            if changed:
                self.links.save()
                self.save()
        self.wake.unpark_all()

    def next(self) -> CopyJob | None:
        for key, job in self.jobs.items():
            if key in self.running:
                continue
            node = self.ns.get(job.ino)
            if (node is not None and node.linked and self.markers.rules.is_marker_name(node.name)
                    and job.move and not self.markers.step_ready(node)):
                continue  # a commit marker comes last, as in uploads
            return job
        return None

    async def run(self, job: CopyJob) -> Inode | None:
        """Make one copy (taken from next()). Returns a file to upload instead (its copy
        became moot, or its source is gone), else None."""
        self.running.add(job.key())
        try:
            return await self._copy(job)
        finally:
            self.running.discard(job.key())
            self.wake.unpark_all()

    async def _copy(self, job: CopyJob) -> Inode | None:
        node = self.ns.get(job.ino)
        dst_now = (self.ns.path_of(node) if job.move else job.dst) if node is not None \
            and node.linked else None
        if (node is None or not node.linked or node.version != job.version
                or (job.move and dst_now != job.dst)
                or (not job.move and job.dst not in self.ns.link_paths(node))):
            # Removed, rewritten or renamed again meanwhile: this copy is moot (a rename
            # queued a new one; a rewrite uploads anew). A moved source still goes.
            self.jobs.pop(job.key(), None)
            with self.ns.store.transaction():
                if job.move:
                    self.deletes.later(job.src, job.src_gen)
                self.save()
            return node if node is not None and node.linked and node.state == CLOSED else None
        stats = self.backoff.stats
        try:
            info = await trio.to_thread.run_sync(partial(
                self.tier.copy, job.src, job.dst, src_generation=job.src_gen,
                if_generation_match=job.dst_gen), limiter=self.limiter, abandon_on_cancel=True)
        except PreconditionFailed:
            info = await trio.to_thread.run_sync(self.tier.stat, job.dst, abandon_on_cancel=True)
            if info is None or info.crc32c != node.crc32c or info.size != node.size:
                msg = (f"conflict: object {job.dst} in {self.tier.url} was changed by someone "
                       f"else; not overwriting it with {job.src}")
                log.error("%s", msg)
                stats.conflicts += 1
                stats.record_error(msg)
                self.jobs.pop(job.key(), None)
                if job.move:
                    self.deletes.release(job.src)
                with self.ns.store.transaction():
                    self.save()
                return None
            # Already there (our own earlier copy, or the writer's upload): adopt it.
        except ObjectNotFound:
            # The source is gone: upload the data instead (its writer, per policy).
            log.warning("copy %s -> %s: the source is gone; uploading instead", job.src,
                        job.dst)
            self.jobs.pop(job.key(), None)
            if job.move:
                self.deletes.release(job.src)
            with self.ns.store.transaction():
                self.save()
            if job.move:
                node.copy_grace = 0.0
                return node
            return None
        except (Unavailable, DurableError, OSError) as e:
            self.backoff.failed(f"copy {job.src} to {job.dst}: {e}")
            return None
        self.backoff.succeeded()
        stats.copies += 1
        self.jobs.pop(job.key(), None)
        with self.ns.store.transaction():
            if job.move:
                self.deletes.later(job.src, job.src_gen)
            elif node.linked and job.dst in self.ns.link_paths(node):
                self.links.objects.setdefault(node.ino, {})[job.dst] = [info.generation,
                                                                        job.version]
                self.links.save()
            elif not (node.linked and self.ns.path_of(node) == job.dst):
                # That name went while the copy ran: its object goes too.
                self.deletes.later(job.dst, info.generation)
            # (Else the further name became the file's own while the copy ran, its
            # first name unlinked: the upload queued then adopts this object.)
            self.save()
        log.info("copied %s to %s in %s (generation %d)", job.src, job.dst, self.tier.url,
                 info.generation)
        if job.move:
            self.copies.persisted(node, info.generation, job.version)  # announced there
            self.sync_links(node)
        return None
