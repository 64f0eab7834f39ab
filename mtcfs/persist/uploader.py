"""The uploader: persists sealed files to the durable tier in the background.

- Never blocks write() or close(): the filesystem only notifies it; uploads run
  in worker threads with bounded concurrency.
- Commit ordering: a commit marker is uploaded only after every other file of
  its step directory is persisted, and while every host is alive and caught up
  with, or gone for good (a host cut off for a moment may hold files of the step
  nobody here has seen), so the bucket never shows a marker for a partial step.
- Nothing under a temporary name is uploaded (it will be, under its final name,
  once renamed). A rename of persisted data ends with every file under its new
  name in the bucket: the renaming host copies each object server-side (GCS
  rewrite; no data through any host) and deletes the old object only once the
  copy is there; files not yet persisted are uploaded under the new name by
  their writer. Deleted files' objects are deleted (generation precondition);
  pending copies and deletions survive a restart.
- A hard-linked file is stored once per name (GCS has no links): its writer
  copies the object to each further name and keeps them in step.
- Retries forever with exponential backoff while the tier is unreachable: the
  data stays in RAM meanwhile. A generation precondition makes sure a stale
  node cannot overwrite a newer object.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.checksums import (
    CHUNK_META_KEY,
    chunk_crcs_from_blocks,
    chunk_crcs_of_fd,
    crc_of_chunks,
    encode_chunk_meta,
)
from mtcfs.events import Listener
from mtcfs.fs.namespace import CLOSED, ROOT, Inode, Namespace
from mtcfs.lifecycle.copies import Copies
from mtcfs.persist.policy import Mode, PersistPolicy
from mtcfs.persist.steps import (
    StepRules,
    all_steps,
    dirs_under,
    files_under,
    newest_complete_step,
)
from mtcfs.tiers.durable import (
    DurableError,
    DurableTier,
    IntegrityError,
    ObjectNotFound,
    PreconditionFailed,
    Unavailable,
)

if TYPE_CHECKING:
    from mtcfs.tiers.ram import RamTier

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0
HELD_LOG = 30.0  # a commit marker held this long is logged, with why
REQUESTED_KEY = "persist_requested"  # metadata store: inos `mtcfs persist` asked for
COPIES_KEY = "pending_copies"  # metadata store: server-side copies still to do
LINKS_KEY = "link_objects"  # metadata store: objects of hard links' further names
# A host that sees another host rename persisted data leaves the copies to it this long
# before it uploads its own files under the new name itself.
COPY_GRACE = 60.0


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


class FileChangedError(Exception):
    pass


@dataclass
class Stats:
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    inflight_bytes_done: int = 0
    deletes: int = 0
    errors: int = 0
    last_error: str = ""
    last_error_time: float = 0.0
    conflicts: int = 0
    copies: int = 0


class Uploader(Listener):
    def __init__(self, ns: Namespace, ram: RamTier, tier: DurableTier, policy: PersistPolicy,
                 rules: StepRules, copies: Copies, events: Listener,
                 node_id: str = "", concurrency: int = 4,
                 hosts_accounted: Callable[[], bool] = lambda: True) -> None:
        """`hosts_accounted()`: every host of the job is alive or gone for good (a
        marker waits meanwhile: a host cut off may hold files of its step unseen)."""
        self.ns = ns
        self.ram = ram
        self.tier = tier
        self.copies = copies  # where a file's copies are: records persisted state
        # persisted: the peer tier announces it, the lifecycle counts; copy_wanted: the
        # fetcher brings another host's file here (`mtcfs persist` of a file this host
        # did not write and holds no copy of).
        self.events = events
        # With peers, each host uploads the files it wrote; the others learn that a file
        # is persisted from the index. Without peers (""), this host owns every file.
        self.node_id = node_id
        self.policy = policy
        self.rules = rules
        self.concurrency = concurrency
        self.hosts_accounted = hosts_accounted
        self._markers_held = False  # a marker waits for a host to come back or be gone
        # Commit markers waiting to go: ino -> (since, why, last logged), for the log and
        # the status.
        self._held: dict[int, tuple[float, str, float]] = {}
        self.queue: dict[int, Inode] = {}  # insertion-ordered: FIFO
        self.inflight: dict[int, Inode] = {}
        self.failed: dict[int, str] = {}  # conflicts that need a person
        self.deletes: dict[str, int] = dict(ns.store.load_pending_deletes())
        self._deleting: set[str] = set()  # deletes running now
        self._marker_deletes = {k for k in self.deletes if self._is_marker_key(k)}
        self._uploading: dict[int, str] = {}  # ino -> key, uploads running now
        # Files `mtcfs persist` asked for and not yet persisted: kept in the
        # metadata store, so a request survives a daemon crash or restart.
        self.requested: set[int] = set(json.loads(ns.store.get_meta(REQUESTED_KEY) or "[]"))
        self.copy_jobs: dict[tuple[int, str], CopyJob] = {}
        for job in json.loads(ns.store.get_meta(COPIES_KEY) or "[]"):
            j = CopyJob(**job)
            self.copy_jobs[j.key()] = j
        self._copying: set[tuple[int, str]] = set()
        # ino -> {key: [generation, version]}: objects of hard links' further names.
        self.links: dict[int, dict[str, list[int]]] = {
            int(ino): objs for ino, objs in
            json.loads(ns.store.get_meta(LINKS_KEY) or "{}").items()}
        self.stats = Stats()
        self._lot = trio.lowlevel.ParkingLot()
        self._backoff = 0.0
        self._limiter = trio.CapacityLimiter(concurrency)
        # Transient errors the tier retries by itself (GCS outage) show in status at once.
        tier.on_retry = self._tier_retrying

    # -- notifications from the filesystem (never block) -------------------------

    def sealed(self, node: Inode) -> None:
        self.failed.pop(node.ino, None)
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
                    self._add_copy(CopyJob(f.ino, self.ns.path_of(f), old_key, f.generation,
                                           f.version, move=True))
                else:
                    self._delete_later(old_key, f.generation)
                self.copies.unpersisted(f)
            self._save_copies()
        for f in files:
            if f.state == CLOSED and not self._copy_pending(f):
                self.sealed(f)
            self.sync_links(f)
        if node.is_dir and self.policy.mode is Mode.STEP:
            for d in [node, *dirs_under(self.ns, node)]:
                if self.rules.is_committed_step(self.ns, d):
                    self.commit_step(d)
        self._lot.unpark_all()

    def remote_moved(self, node: Inode) -> None:
        """Another host moved `node`: its persisted files are no longer persisted under
        their (new) names until that host's copies land, which it announces."""
        files = [node] if node.is_file else list(files_under(self.ns, node)) if node.is_dir else []
        deadline = time.monotonic() + COPY_GRACE
        with self.ns.store.transaction():
            for f in files:
                if f.generation:
                    self.copies.unpersisted(f)
                    f.copy_grace = deadline
        # Never uploaded (a temporary name, or not yet): the mover has no object to copy
        # and, without the data, does not upload; the host that sealed it does.
        for f in files:
            if not f.generation and f.state == CLOSED and self.owns(f):
                self.sealed(f)

    def name_removed(self, node: Inode, path: str, was_own: bool) -> None:
        """A hard-linked file lost the name at `path` (it keeps others)."""
        objs = self.links.get(node.ino, {})
        with self.ns.store.transaction():
            if was_own and node.generation:
                # The file is now known by its oldest further name: that object, if in
                # step, becomes the file's own; the old name's object goes.
                self._delete_later(path, node.generation)
                adopted = objs.pop(self.ns.path_of(node), None)
                if adopted is not None and adopted[1] == node.version:
                    self.copies.persisted(node, adopted[0], node.version)
                else:
                    if adopted is not None:
                        self._delete_later(self.ns.path_of(node), adopted[0])
                    self.copies.unpersisted(node)
            elif not was_own and path in objs:
                self._delete_later(path, objs.pop(path)[0])
            self._save_links()
        if not node.persisted and node.state == CLOSED:
            self.sealed(node)
        self.sync_links(node)

    def resealed(self, node: Inode) -> None:
        """Sealed again unchanged: queued again if it was not persisted yet."""
        self.sealed(node)

    def linked(self, node: Inode) -> None:
        self.sync_links(node)

    def sync_links(self, node: Inode) -> None:
        """Bring the objects of a hard-linked file's further names in line with its
        names and its persisted version (this host's files only)."""
        objs = self.links.get(node.ino)
        if not node.links and not objs:
            return
        if not self.owns(node):
            return
        objs = self.links.setdefault(node.ino, {})
        want = set(self.ns.link_paths(node)) if node.linked else set()
        changed = False
        with self.ns.store.transaction():
            for key in [k for k in objs if k not in want]:
                self._delete_later(key, objs.pop(key)[0])
                changed = True
            if node.persisted:
                for key in sorted(want):
                    have = objs.get(key)
                    if have is None or have[1] != node.version:
                        self._add_copy(CopyJob(node.ino, key, self.ns.path_of(node),
                                               node.generation, node.version, move=False,
                                               dst_gen=have[0] if have else 0))
                        changed = True
            if not objs:
                self.links.pop(node.ino, None)
            if changed:
                self._save_links()
                self._save_copies()
        self._lot.unpark_all()

    def links_in_step(self, node: Inode) -> bool:
        """Every further name of the file has its object at the file's version."""
        objs = self.links.get(node.ino, {})
        return all(objs.get(k, (0, -1))[1] == node.version for k in self.ns.link_paths(node))

    def _add_copy(self, job: CopyJob) -> None:
        self.copy_jobs[job.key()] = job

    def _copy_pending(self, node: Inode) -> bool:
        return any(ino == node.ino and j.move for (ino, _), j in self.copy_jobs.items())

    def _save_copies(self) -> None:
        self.ns.store.set_meta(COPIES_KEY, json.dumps([vars(j) for j in self.copy_jobs.values()]))

    def _save_links(self) -> None:
        self.ns.store.set_meta(LINKS_KEY, json.dumps({str(k): v for k, v in self.links.items()}))

    def removed(self, node: Inode, path: str) -> None:
        """A file was unlinked (or replaced by a rename) at `path`: its last name."""
        if not node.is_file:
            return
        self.queue.pop(node.ino, None)
        self.failed.pop(node.ino, None)
        self._unrequest(node.ino)
        with self.ns.store.transaction():
            if node.generation:
                self._delete_later(path, node.generation)
            self.copies.name_gone(node)
            for key in [k for k in self.copy_jobs if k[0] == node.ino]:
                job = self.copy_jobs.pop(key)
                if job.move:
                    self._delete_later(job.src, job.src_gen)  # the copy's source goes too
            for key, (gen, _) in self.links.pop(node.ino, {}).items():
                self._delete_later(key, gen)
            self._save_copies()
            self._save_links()

    def rewriting(self, node: Inode) -> None:
        """A sealed file is being written again: its queued upload waits for the seal."""
        self.queue.pop(node.ino, None)

    # -- requests ----------------------------------------------------------------------

    def commit_step(self, d: Inode) -> int:
        # Not files under temporary names: they are uploaded once renamed into place.
        files = [f for f in files_under(self.ns, d)
                 if f.state == CLOSED and not self._temporary_below(f, d)]
        # Markers last: FIFO order plus the marker gate below.
        files.sort(key=lambda f: self.rules.is_marker_name(f.name))
        for f in files:
            self._enqueue(f)
        return len(files)

    def request(self, nodes: list[Inode]) -> tuple[int, int]:
        """`mtcfs persist`: persist these files now, whatever the policy."""
        files = sorted((n for n in nodes if n.is_file and n.state == CLOSED),
                       key=lambda f: self.rules.is_marker_name(f.name))
        wanted = {f.ino for f in files if not f.persisted}
        if wanted - self.requested:
            self.requested |= wanted
            self._save_requested()
        for f in files:
            self.failed.pop(f.ino, None)
            self._enqueue(f)
        return len(files), sum(f.size for f in files)

    def _unrequest(self, ino: int) -> None:
        if ino in self.requested:
            self.requested.discard(ino)
            self._save_requested()

    def _save_requested(self) -> None:
        with self.ns.store.transaction():
            self.ns.store.set_meta(REQUESTED_KEY, json.dumps(sorted(self.requested)))

    def owns(self, node: Inode) -> bool:
        """This host uploads the files it sealed (all of them without peers), whoever
        renamed them since."""
        return not self.node_id or not node.author or node.author == self.node_id

    def peers_changed(self) -> None:
        """A host came back (or went): a marker held for it may go now."""
        if self._markers_held:
            self._lot.unpark_all()

    def remote_changed(self, nodes: list[Inode]) -> None:
        """Changes from other hosts: a step they committed (a marker, a directory
        renamed into place) commits our files in it too; a file they persisted may
        be the last one a marker here waits for."""
        for n in nodes:
            if n.is_file and (n.links or n.ino in self.links):
                self.sync_links(n)
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
        if node.ino in self.queue:
            self._lot.unpark_all()

    def fetch_failed(self, node: Inode, why: str) -> None:
        if (node.ino in self.requested or self.owns(node)) and node.ino in self.queue:
            # Shown by `mtcfs persist` as failed; asked again, it is tried again.
            self.failed[node.ino] = f"no copy could be fetched: {why}"
            log.error("cannot persist %s: no copy could be fetched: %s",
                      self.ns.path_of(node) if node.linked else node.guid, why)

    def _delete_later(self, key: str, generation: int) -> None:
        self.deletes[key] = generation
        if self._is_marker_key(key):
            self._marker_deletes.add(key)
        self.ns.store.add_pending_delete(key, generation)
        self._lot.unpark_all()

    def _is_marker_key(self, key: str) -> bool:
        return self.rules.is_marker_name(key.rpartition("/")[2].encode("utf-8", "surrogateescape"))

    def _next_delete(self) -> tuple[str, int] | None:
        """Commit markers first, and nothing else while one is being deleted: a
        step that loses its objects stops looking committed before it is partial."""
        key = next(iter(self._marker_deletes), None)
        if key is not None:
            self._marker_deletes.discard(key)
            if key in self.deletes:
                return key, self.deletes.pop(key)
            return self._next_delete()
        if not self.deletes or any(self._is_marker_key(k) for k in self._deleting):
            return None
        key = next(iter(self.deletes))
        return key, self.deletes.pop(key)

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
            "pending_deletes": len(self.deletes),
            "pending_copies": len(self.copy_jobs),
            "copied_objects": self.stats.copies,
            "uploaded_files": self.stats.files_uploaded,
            "uploaded_bytes": self.stats.bytes_uploaded,
            "deleted_objects": self.stats.deletes,
            "errors": self.stats.errors,
            "conflicts": len(self.failed),
            "last_error": self.stats.last_error or None,
            "last_error_age": (round(time.time() - self.stats.last_error_time, 1)
                               if self.stats.last_error else None),
            "retrying_in": round(self._backoff, 1) if self._backoff else 0,
            "markers_held": [
                {"path": self.ns.path_of(n), "seconds": round(time.monotonic() - since, 1),
                 "why": why}
                for ino, (since, why, _) in self._held.items()
                if (n := self.queue.get(ino)) is not None and n.linked],
        }

    def idle(self) -> bool:
        return not self.queue and not self.inflight and not self.deletes and not self.copy_jobs

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
        for ino in sorted(self.requested):
            node = self.ns.get(ino)
            if node is None or not node.is_file or not node.linked:
                self._unrequest(ino)
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
        for ino in [i for i in self._held if i not in self.queue]:  # gone from the queue
            del self._held[ino]
        for ino, node in list(self.queue.items()):
            if not node.linked or node.state != CLOSED or node.persisted:
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
            if self._copy_pending(node) or node.copy_grace > time.monotonic():
                continue  # a server-side copy brings it under its new name
            if self.rules.is_marker_name(node.name):
                waiting = self._unpersisted_in_step(node)
                if waiting is not None:
                    self._hold(node, f"waits for {self.ns.path_of(waiting)} (written by "
                               f"{waiting.author or 'this host'}) to be persisted")
                    continue
                if not self.hosts_accounted():
                    # A host cut off for a moment may have written files of this step
                    # that no host here has seen: they would be missing beside the marker.
                    self._markers_held = True
                    self._hold(node, "waits for every host to be alive and caught up with "
                               "(or gone for good)")
                    continue
                self._held.pop(ino, None)
            if (self.deletes or self._deleting or self._uploading) and self._delete_pending(node):
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
        return (key in self.deletes or key in self._deleting
                or key in self._uploading.values())

    def _step_ready(self, marker: Inode) -> bool:
        """Every non-marker file in the marker's directory tree is persisted."""
        return self._unpersisted_in_step(marker) is None

    def _unpersisted_in_step(self, marker: Inode) -> Inode | None:
        """A file the marker waits for (the first found): one in its directory tree not
        persisted yet; None when there is none."""
        d = self.ns.inodes[marker.parent]
        # Files under temporary names are no part of the step (and are never uploaded
        # by the on-close and step policies): they must not hold the marker back.
        return next((f for f in files_under(self.ns, d)
                     if f.linked and not ((f.persisted and self.links_in_step(f))
                                          or self.rules.is_marker_name(f.name)
                                          or self._temporary_below(f, d))), None)

    def _hold(self, marker: Inode, why: str) -> None:
        """A commit marker waits: said in `status`, and in the log once it has waited
        HELD_LOG seconds (then at most every HELD_LOG seconds)."""
        now = time.monotonic()
        since, _, logged = self._held.get(marker.ino, (now, "", -math.inf))
        if now - since >= HELD_LOG and now - logged >= HELD_LOG:
            log.warning("commit marker %s %s (for %.0f s)", self.ns.path_of(marker), why,
                        now - since)
            logged = now
        self._held[marker.ino] = (since, why, logged)

    def _temporary_below(self, f: Inode, d: Inode) -> bool:
        """True if `f` or a directory between it and `d` has a temporary name."""
        node = f
        while node.ino != d.ino and node.ino != ROOT:
            if self.rules.is_temporary_name(node.name):
                return True
            node = self.ns.inodes[node.parent]
        return False

    async def _worker(self) -> None:
        while True:
            if self._backoff:
                await trio.sleep(self._backoff)
            copy = self._next_copy()
            if copy is not None:
                self._copying.add(copy.key())
                try:
                    await self._copy(copy)
                finally:
                    self._copying.discard(copy.key())
                    self._lot.unpark_all()
                continue
            job = self._next_delete()
            if job is not None:
                key, gen = job
                self._deleting.add(key)
                try:
                    await self._delete(key, gen)
                finally:
                    self._deleting.discard(key)
                    self._lot.unpark_all()  # an upload to the same key may go now
                continue
            self._markers_held = False
            node = self._next_job()
            if node is None:
                # A marker held for a host is looked at again each second (a host's
                # grace ends); one waiting for files, every HELD_LOG seconds too (said
                # in the log if it still waits).
                with trio.move_on_after(1.0 if self._markers_held
                                        else HELD_LOG if self._held else math.inf):
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

    def _next_copy(self) -> CopyJob | None:
        for key, job in self.copy_jobs.items():
            if key in self._copying:
                continue
            node = self.ns.get(job.ino)
            if (node is not None and node.linked and self.rules.is_marker_name(node.name)
                    and job.move and not self._step_ready(node)):
                continue  # a commit marker comes last, as in uploads
            return job
        return None

    async def _copy(self, job: CopyJob) -> None:
        node = self.ns.get(job.ino)
        dst_now = (self.ns.path_of(node) if job.move else job.dst) if node is not None \
            and node.linked else None
        if (node is None or not node.linked or node.version != job.version
                or (job.move and dst_now != job.dst)
                or (not job.move and job.dst not in self.ns.link_paths(node))):
            # Removed, rewritten or renamed again meanwhile: this copy is moot (a rename
            # queued a new one; a rewrite uploads anew). A moved source still goes.
            self.copy_jobs.pop(job.key(), None)
            with self.ns.store.transaction():
                if job.move:
                    self._delete_later(job.src, job.src_gen)
                self._save_copies()
            if node is not None and node.linked and node.state == CLOSED:
                self.sealed(node)
            return
        try:
            info = await trio.to_thread.run_sync(partial(
                self.tier.copy, job.src, job.dst, src_generation=job.src_gen,
                if_generation_match=job.dst_gen), limiter=self._limiter, abandon_on_cancel=True)
        except PreconditionFailed:
            info = await trio.to_thread.run_sync(self.tier.stat, job.dst, abandon_on_cancel=True)
            if info is None or info.crc32c != node.crc32c or info.size != node.size:
                msg = (f"conflict: object {job.dst} in {self.tier.url} was changed by someone "
                       f"else; not overwriting it with {job.src}")
                log.error("%s", msg)
                self.stats.conflicts += 1
                self._record_error(msg)
                self.copy_jobs.pop(job.key(), None)
                with self.ns.store.transaction():
                    self._save_copies()
                return
            # Already there (our own earlier copy, or the writer's upload): adopt it.
        except ObjectNotFound:
            # The source is gone: upload the data instead (its writer, per policy).
            log.warning("copy %s -> %s: the source is gone; uploading instead", job.src,
                        job.dst)
            self.copy_jobs.pop(job.key(), None)
            with self.ns.store.transaction():
                self._save_copies()
            if job.move:
                node.copy_grace = 0.0
                self.sealed(node)
            return
        except (Unavailable, DurableError, OSError) as e:
            self._failed_attempt(f"copy {job.src} to {job.dst}: {e}")
            return
        self._backoff = 0.0
        self.stats.copies += 1
        self.copy_jobs.pop(job.key(), None)
        with self.ns.store.transaction():
            if job.move:
                self.copies.persisted(node, info.generation, job.version)
                self._delete_later(job.src, job.src_gen)
            else:
                self.links.setdefault(node.ino, {})[job.dst] = [info.generation, job.version]
                self._save_links()
            self._save_copies()
        log.info("copied %s to %s in %s (generation %d)", job.src, job.dst, self.tier.url,
                 info.generation)
        if job.move:
            self.events.persisted(node)
            self.sync_links(node)

    async def _delete(self, key: str, gen: int) -> None:
        try:
            await trio.to_thread.run_sync(partial(self.tier.delete, key, if_generation_match=gen),
                                          limiter=self._limiter, abandon_on_cancel=True)
        except PreconditionFailed:
            log.warning("not deleting object %s: it was replaced by someone else", key)
        except (Unavailable, DurableError, OSError) as e:
            self.deletes.setdefault(key, gen)
            if self._is_marker_key(key):
                self._marker_deletes.add(key)
            self._failed_attempt(f"delete {key}: {e}")
            return
        self.stats.deletes += 1
        self._backoff = 0.0
        if key not in self.deletes:  # not removed again meanwhile (a newer generation)
            with self.ns.store.transaction():
                self.ns.store.remove_pending_delete(key)

    async def _upload(self, node: Inode) -> None:
        key = self.ns.path_of(node)
        version, crc, size, gen = node.version, node.crc32c, node.size, node.generation
        blocks = node.block_crcs
        assert crc is not None
        path = self.ram.path(node.ino)
        done = 0

        def progress(offset: int, length: int) -> None:
            nonlocal done
            done += length
            self.stats.inflight_bytes_done += length

        def put() -> Any:
            if blocks is not None:  # the chunks' crcs follow from the blocks': no pass
                chunk, crcs = chunk_crcs_from_blocks(blocks, size)
            else:  # sealed before per-block crcs were kept: one pass
                fd = self.ram.open_read(node.ino)
                try:
                    chunk, crcs = chunk_crcs_of_fd(fd, size)
                finally:
                    os.close(fd)
                if crc_of_chunks(chunk, crcs, size) != crc:
                    raise FileChangedError(key)
            try:
                return self.tier.put_file(
                    key, path, crc, if_generation_match=gen, progress=progress,
                    metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)},
                )
            except IntegrityError:
                # The data changed since the seal (rewritten in place): the upload is
                # refused by its checksum; the next seal queues the new version.
                raise FileChangedError(key) from None

        t0 = time.monotonic()
        try:
            try:
                info = await trio.to_thread.run_sync(put, limiter=self._limiter,
                                                     abandon_on_cancel=True)
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
                    self._record_error(msg)
                    return
                # Our own earlier upload landed (e.g. before a crash): adopt it.
        except (FileNotFoundError, FileChangedError):
            if node.linked and node.state == CLOSED and not node.dirty and not node.has_data:
                # Not removed nor changed: its data left this host's RAM (lost with
                # the RAM dir). Nothing here can upload it: say so, never silently.
                msg = f"cannot persist {key}: its data is no longer in this host's RAM"
                self._record_error(msg)
                log.error("%s", msg)
            return  # removed, or changed since its seal: its next seal queues it again
        except ValueError as e:
            # A name the durable tier cannot store (e.g. a newline in it): retrying
            # cannot help, and it must not take the uploader (and the mount) down.
            msg = f"cannot persist {key!r}: {e}"
            log.error("%s", msg)
            self.failed[node.ino] = msg
            self._record_error(msg)
            return
        except (Unavailable, DurableError, OSError) as e:
            if not node.linked:
                return  # removed meanwhile (its RAM data may be gone): nothing to do
            self._enqueue_front(node)
            self._failed_attempt(f"upload {key}: {e}")
            return
        finally:
            self.stats.inflight_bytes_done -= done
        self._backoff = 0.0
        self.stats.files_uploaded += 1
        self.stats.bytes_uploaded += size
        still_here = node.linked and self.ns.path_of(node) == key
        with self.ns.store.transaction():
            if not still_here:
                # Renamed or removed while uploading: that object is stale.
                self._delete_later(key, info.generation)
            else:
                self.copies.persisted(node, info.generation, version)
                if node.version == version:
                    self._unrequest(node.ino)
        log.info("persisted %s (%d bytes, generation %d) in %.2f s", key, size, info.generation,
                 time.monotonic() - t0)
        if still_here:
            self.events.persisted(node)
            self.sync_links(node)
        elif node.linked and node.state == CLOSED:
            self.sealed(node)  # renamed while uploading: upload it under its new name
        if still_here and node.version != version:
            self.sealed(node)

    def _enqueue_front(self, node: Inode) -> None:
        rest = dict(self.queue)
        self.queue = {node.ino: node, **rest}

    def _failed_attempt(self, msg: str) -> None:
        self._backoff = min(MAX_BACKOFF, max(0.5, self._backoff * 2)) * random.uniform(0.8, 1.2)
        self._record_error(msg)
        log.warning("%s; retrying in %.1f s", msg, self._backoff)

    def _record_error(self, msg: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = msg
        self.stats.last_error_time = time.time()

    def _tier_retrying(self, msg: str) -> None:
        """Called from worker threads while the tier retries a transient error."""
        self._record_error(msg)
