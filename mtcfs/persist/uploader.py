"""The uploader: persists sealed files to the durable tier in the background.

- Never blocks write() or close(): the filesystem only notifies it; uploads run
  in worker threads with bounded concurrency.
- Commit ordering: a commit marker is uploaded only after every other file of
  its step directory is persisted, so the bucket never shows a marker for a
  partial step.
- Nothing under a temporary name is uploaded (it will be, under its final name,
  once renamed); renamed or deleted persisted files have their old objects
  deleted (with a generation precondition), and those deletions survive a
  restart.
- Retries forever with exponential backoff while the tier is unreachable: the
  data stays in RAM meanwhile. A generation precondition makes sure a stale
  node cannot overwrite a newer object.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from mtcfs.fs.namespace import CLOSED, ROOT, Inode, Namespace
from mtcfs.persist.policy import Mode, PersistPolicy
from mtcfs.persist.steps import StepRules, all_steps, files_under, step_number
from mtcfs.tiers.durable import DurableError, DurableTier, PreconditionFailed, Unavailable
from mtcfs.tiers.durable.base import (
    CHUNK_META_KEY,
    chunk_crcs_of_fd,
    crc_of_chunks,
    encode_chunk_meta,
)

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0


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


class Uploader:
    def __init__(self, ns: Namespace, data_path: Any, tier: DurableTier, policy: PersistPolicy,
                 rules: StepRules, concurrency: int = 4) -> None:
        self.ns = ns
        self.data_path = data_path  # ino -> path of its data in the RAM tier
        self.tier = tier
        self.policy = policy
        self.rules = rules
        self.concurrency = concurrency
        self.queue: dict[int, Inode] = {}  # insertion-ordered: FIFO
        self.inflight: dict[int, Inode] = {}
        self.failed: dict[int, str] = {}  # conflicts that need a person
        self.deletes: dict[str, int] = dict(ns.store.load_pending_deletes())
        self.stats = Stats()
        self._lot = trio.lowlevel.ParkingLot()
        self._backoff = 0.0
        self._limiter = trio.CapacityLimiter(concurrency)

    # -- notifications from the filesystem (never block) -------------------------

    def on_sealed(self, node: Inode) -> None:
        self.failed.pop(node.ino, None)
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
            if step is not None:  # a file added to an already committed step
                self._enqueue(node)

    def on_renamed(self, node: Inode, old_path: str) -> None:
        """`node` (a file or a directory) was moved from `old_path`."""
        files = [node] if node.is_file else list(files_under(self.ns, node)) if node.is_dir else []
        new_path = self.ns.path_of(node)
        with self.ns.store.transaction():
            for f in files:
                if f.generation:
                    old_key = old_path + self.ns.path_of(f)[len(new_path):]
                    self._delete_later(old_key, f.generation)
                    f.generation = 0
                    f.persisted_version = 0
                    self.ns.persist(f)
        for f in files:
            if f.state == CLOSED:
                self.on_sealed(f)
        if node.is_dir and self.policy.mode is Mode.STEP:
            for d in [node, *self._dirs_under(node)]:
                if self.rules.is_committed_step(self.ns, d):
                    self.commit_step(d)

    def on_removed(self, node: Inode, path: str) -> None:
        """A file was unlinked (or replaced by a rename) at `path`."""
        self.queue.pop(node.ino, None)
        self.failed.pop(node.ino, None)
        if node.generation:
            with self.ns.store.transaction():
                self._delete_later(path, node.generation)
            node.generation = 0

    def on_changed(self, node: Inode) -> None:
        """A sealed file is being written again: its queued upload waits for the seal."""
        self.queue.pop(node.ino, None)

    # -- requests ----------------------------------------------------------------------

    def commit_step(self, d: Inode) -> int:
        files = [f for f in files_under(self.ns, d) if f.state == CLOSED]
        # Markers last: FIFO order plus the marker gate below.
        files.sort(key=lambda f: self.rules.is_marker_name(f.name))
        for f in files:
            self._enqueue(f)
        return len(files)

    def request(self, nodes: list[Inode]) -> tuple[int, int]:
        """`mtcfs persist`: persist these files now, whatever the policy."""
        files = sorted((n for n in nodes if n.is_file and n.state == CLOSED),
                       key=lambda f: self.rules.is_marker_name(f.name))
        for f in files:
            self.failed.pop(f.ino, None)
            self._enqueue(f, explicit=True)
        return len(files), sum(f.size for f in files)

    def _enqueue(self, node: Inode, explicit: bool = False) -> None:
        if node.persisted or node.ino in self.inflight:
            return
        self.queue[node.ino] = node
        self._lot.unpark_all()

    def _delete_later(self, key: str, generation: int) -> None:
        self.deletes[key] = generation
        self.ns.store.add_pending_delete(key, generation)
        self._lot.unpark_all()

    def _dirs_under(self, d: Inode) -> list[Inode]:
        out, stack = [], [d]
        while stack:
            cur = stack.pop()
            for ino in (cur.children or {}).values():
                child = self.ns.inodes[ino]
                if child.is_dir:
                    out.append(child)
                    stack.append(child)
        return out

    # -- status ----------------------------------------------------------------------

    def pending_bytes(self) -> int:
        return sum(n.size for n in self.queue.values()) + sum(
            n.size for n in self.inflight.values()) - self.stats.inflight_bytes_done

    def status(self) -> dict[str, Any]:
        return {
            "url": self.tier.url,
            "policy": str(self.policy),
            "queued_files": len(self.queue),
            "inflight_files": len(self.inflight),
            "pending_bytes": max(0, self.pending_bytes()),
            "pending_deletes": len(self.deletes),
            "uploaded_files": self.stats.files_uploaded,
            "uploaded_bytes": self.stats.bytes_uploaded,
            "deleted_objects": self.stats.deletes,
            "errors": self.stats.errors,
            "conflicts": len(self.failed),
            "last_error": self.stats.last_error or None,
            "last_error_age": (round(time.time() - self.stats.last_error_time, 1)
                               if self.stats.last_error else None),
            "retrying_in": round(self._backoff, 1) if self._backoff else 0,
        }

    def idle(self) -> bool:
        return not self.queue and not self.inflight and not self.deletes

    async def drain(self) -> None:
        """Wait until nothing is queued or in flight (failed conflicts excepted)."""
        while not self.idle():
            await trio.sleep(0.05)

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
            steps = [d for d in all_steps(self.ns, self.rules)
                     if self.rules.is_committed_step(self.ns, d)]
            if steps:
                newest = max(steps, key=lambda d: (step_number(d.name) or -1, d.mtime_ns))
                self.commit_step(newest)

    def _next_job(self) -> Inode | None:
        for ino, node in list(self.queue.items()):
            if not node.linked or node.state != CLOSED or node.persisted:
                del self.queue[ino]
                continue
            if node.writers or node.dirty:
                continue  # being rewritten: the next seal queues it again
            if self.rules.is_marker_name(node.name) and not self._step_ready(node):
                continue
            del self.queue[ino]
            return node
        return None

    def _step_ready(self, marker: Inode) -> bool:
        """Every non-marker file in the marker's directory tree is persisted."""
        d = self.ns.inodes[marker.parent]
        return all(f.persisted or self.rules.is_marker_name(f.name)
                   for f in files_under(self.ns, d) if f.linked)

    async def _worker(self) -> None:
        while True:
            if self._backoff:
                await trio.sleep(self._backoff)
            if self.deletes:
                key, gen = next(iter(self.deletes.items()))
                self.deletes.pop(key)
                await self._delete(key, gen)
                continue
            node = self._next_job()
            if node is None:
                await self._lot.park()
                continue
            self.inflight[node.ino] = node
            try:
                await self._upload(node)
            finally:
                self.inflight.pop(node.ino, None)
                self._lot.unpark_all()  # a marker may be ready now

    async def _delete(self, key: str, gen: int) -> None:
        try:
            await trio.to_thread.run_sync(partial(self.tier.delete, key, if_generation_match=gen),
                                          limiter=self._limiter)
        except PreconditionFailed:
            log.warning("not deleting gs object %s: it was replaced by someone else", key)
        except (Unavailable, DurableError, OSError) as e:
            self.deletes.setdefault(key, gen)
            self._failed_attempt(f"delete {key}: {e}")
            return
        self.stats.deletes += 1
        self._backoff = 0.0
        with self.ns.store.transaction():
            self.ns.store.remove_pending_delete(key)

    async def _upload(self, node: Inode) -> None:
        key = self.ns.path_of(node)
        version, crc, size = node.version, node.crc32c, node.size
        assert crc is not None
        path = self.data_path(node.ino)
        done = 0

        def progress(offset: int, length: int) -> None:
            nonlocal done
            done += length
            self.stats.inflight_bytes_done += length

        def put() -> Any:
            fd = os.open(path, os.O_RDONLY)
            try:
                chunk, crcs = chunk_crcs_of_fd(fd, size)
            finally:
                os.close(fd)
            if crc_of_chunks(chunk, crcs, size) != crc:
                # The data changed since the seal (rewritten in place): the next
                # seal queues the new version.
                raise FileChangedError(key)
            return self.tier.put_file(
                key, path, crc, if_generation_match=node.generation, progress=progress,
                metadata={CHUNK_META_KEY: encode_chunk_meta(chunk, crcs)},
            )

        t0 = time.monotonic()
        try:
            info = await trio.to_thread.run_sync(put, limiter=self._limiter)
        except PreconditionFailed:
            info = await trio.to_thread.run_sync(self.tier.stat, key)
            if info is None or info.crc32c != crc or info.size != size:
                msg = (f"conflict: gs object {key} was changed by someone else since this node "
                       f"last saw it; not overwriting (rename or remove the local file)")
                log.error("%s", msg)
                self.failed[node.ino] = msg
                self.stats.conflicts += 1
                self._record_error(msg)
                return
            # Our own earlier upload landed (e.g. before a crash): adopt it.
        except (FileNotFoundError, FileChangedError):
            return  # removed, or changed since its seal: its next seal queues it again
        except (Unavailable, DurableError, OSError) as e:
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
                node.generation = info.generation
                if node.version == version:
                    node.persisted_version = version
                self.ns.persist(node)
        log.info("persisted %s (%d bytes, generation %d) in %.2f s", key, size, info.generation,
                 time.monotonic() - t0)
        if still_here and node.version != version:
            self.on_sealed(node)

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


def newest_complete_step(ns: Namespace, rules: StepRules) -> Inode | None:
    steps = [d for d in all_steps(ns, rules) if rules.is_committed_step(ns, d)]
    if not steps:
        return None
    return max(steps, key=lambda d: (step_number(d.name) or -1, d.mtime_ns))


__all__ = ["Mode", "PersistPolicy", "Uploader", "newest_complete_step", "ROOT"]
