"""The bucket's tree, merged into the namespace.

The whole prefix is listed when the daemon starts (before the mount is
announced live, so a fresh mount over a bucket shows every step at once) and
again every `refresh` seconds in the background. A refresh adds objects that
appeared and picks up newer generations of files this node holds only as
persisted copies; it never removes or overwrites local changes. What it does
remove, on every host, are ghosts: entries known only from a listing (never
written or changed by any host, no copy anywhere) whose object is gone. A host
that starts with an empty RAM dir lists the bucket while a rename's old objects
(a withdrawn or reinstated step's other name) are not deleted yet; it cannot
tell them from the live ones, so it merges both and announces them to the
others. Once their delete lands, every host's next listing drops them. An
object under a renamed file's old name whose move no host will make (the host
that renamed it died before its server-side copy) is found by the file's size
and crc32c: not merged, and the file's writer moves it.
"""

from __future__ import annotations

import hashlib
import logging
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import CLOSED, ROOT, Inode, Namespace
from mtcfs.core.versions import Versions
from mtcfs.fs.kernel import KernelCache
from mtcfs.lifecycle.withdrawal import SUFFIX as WITHDRAWN_SUFFIX
from mtcfs.tiers.durable import DurableError, DurableTier, ObjectInfo

log = logging.getLogger(__name__)

DEFAULT_REFRESH = 30.0
NAME_MAX = 255
_WITHDRAWN = WITHDRAWN_SUFFIX.encode()


@dataclass
class Stats:
    listed_objects: int = 0
    last_refresh: float = 0.0
    errors: int = 0
    last_error: str = ""


class BucketListing:
    def __init__(self, ns: Namespace, tier: DurableTier, copies: Copies, versions: Versions,
                 events: Listener, kernel: KernelCache, refresh: float = DEFAULT_REFRESH
                 ) -> None:
        self.ns = ns
        self.tier = tier
        self.copies = copies
        self.versions = versions
        self.events = events
        self.kernel = kernel
        self.refresh = refresh
        self.stats = Stats()
        self._made: set[int] = set()  # names this merge made (see _stale_withdrawal_name)
        # Told of an object that is a renamed file's, still under its old name (the
        # uploader: its owner moves it).
        self.old_objects: list[Callable[[Inode, ObjectInfo], None]] = []

    # -- the tree ----------------------------------------------------------------

    def listing(self) -> list[ObjectInfo]:
        """Every object under the prefix (blocking: at start-up, or in a worker thread)."""
        objects = list(self.tier.list(""))
        self.stats.listed_objects = len(objects)
        self.stats.last_refresh = time.time()
        return objects

    async def load(self, pending_deletes: set[str], full: bool = True) -> int:
        objects = await trio.to_thread.run_sync(self.listing)
        return self.merge(objects, pending_deletes, full)

    def merge(self, objects: list[ObjectInfo], pending_deletes: set[str], full: bool) -> int:
        """Bring the namespace in line with a listing; returns files added or updated."""
        changed = 0
        seen: set[int] = set()
        self._made = set()
        moving: dict[tuple[int, int], list[Inode]] | None = None  # built when first needed
        with self.ns.store.transaction():
            for obj in objects:
                if obj.key in pending_deletes or obj.key.endswith("/"):
                    continue
                here = self._node_at(obj.key)
                if obj.crc32c is not None and (here is None or self._ghost(here)):
                    if moving is None:
                        moving = self._awaiting_move()
                    f = self._moved_away(obj, here, moving)
                else:
                    f = None
                if f is not None:
                    seen.add(f.ino)  # (its object is there, under the old name)
                    continue
                node = self._merge_object(obj)
                if node is not None:
                    seen.add(node.ino)
                    changed += 1
            if full:
                self._forget_vanished(seen)
            else:
                self._forget_ghosts(seen)
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
                if self._stale_withdrawal_name(d, comp, obj.key):
                    return None
                child = self.ns.new_inode(d, comp, stat.S_IFDIR | 0o755, 0, 0)
                self._made.add(child.ino)
            elif not child.is_dir:
                log.warning("skipping bucket object %s: %s is a file here", obj.key,
                            self.ns.path_of(child))
                return None
            d = child
        node = self.ns.child(d, parts[-1])
        if node is None:
            if self._stale_withdrawal_name(d, parts[-1], obj.key):
                return None
            node = self.ns.new_inode(d, parts[-1], stat.S_IFREG | 0o644, 0, 0,
                                     global_id=object_guid(obj))
            self._made.add(node.ino)
            self._take_remote(node, obj)
            self.ns.persist(node)
            return node
        if not node.is_file:
            log.warning("skipping bucket object %s: a directory has that name here", obj.key)
            return None
        if node.generation == obj.generation:
            return node
        if node.state == CLOSED and node.crc32c == obj.crc32c and node.size == obj.size:
            # The same bytes (e.g. our upload landed just before a crash): adopt it
            # (recorded by Copies).
            self.copies.found_in_bucket(node, obj.generation)
            return node
        if node.persisted and not node.opens:
            return self._replace(d, parts[-1], node, obj)
        log.warning("bucket object %s differs from the local, unpersisted file: keeping "
                    "the local one", obj.key)
        return node

    def _awaiting_move(self) -> dict[tuple[int, int], list[Inode]]:
        """Sealed files whose object is not under their name, by size and crc32c: a
        rename leaves a file unpersisted until its server-side copy lands."""
        out: dict[tuple[int, int], list[Inode]] = {}
        for f in self.ns.files():
            if (not f.persisted and f.state == CLOSED and f.linked and f.crc32c is not None
                    and f.size):
                out.setdefault((f.size, f.crc32c), []).append(f)
        return out

    def _node_at(self, key: str) -> Inode | None:
        d: Inode | None = self.ns.inodes[ROOT]
        parts = [p.encode("utf-8", "surrogateescape") for p in key.split("/")]
        for comp in parts[:-1]:
            d = self.ns.child(d, comp) if d is not None and d.is_dir else None
        return self.ns.child(d, parts[-1]) if d is not None and d.is_dir else None

    def _moved_away(self, obj: ObjectInfo, here: Inode | None,
                    moving: dict[tuple[int, int], list[Inode]]) -> Inode | None:
        """The renamed file `obj` holds under its old name, if it is one: no live file
        has that name (a stale copy merged by an earlier listing at most), and exactly
        one unpersisted file has its size and crc32c. Not merged (it would come back
        as a stale copy of the old name on every host); its owner moves it (a chaos
        run: the host that renamed a step died before its copies, and the old name
        stayed for good). A stale copy merged before (by a host that listed while its
        namespace was empty) goes."""
        files = moving.get((obj.size, obj.crc32c or 0), [])
        if len(files) != 1 or files[0] is here or self.ns.path_of(files[0]) == obj.key:
            return None
        f = files[0]
        if here is not None:
            log.warning("%s is the old name of %s, whose object is not moved yet: removing "
                        "it on every host", obj.key, self.ns.path_of(f))
            self.copies.unpersisted(here)  # (the object is f's now: not deleted with it)
            self._remove_ghost(here)
        for tell in self.old_objects:
            tell(f, obj)
        return f

    def _stale_withdrawal_name(self, d: Inode, name: bytes, key: str) -> bool:
        """An object under a step's other name, which this host already knew (not made
        by this merge): a withdrawn step's (or marker's) old name, or a reinstated
        one's withdrawn name. Its object is one whose delete after the server-side
        copy is still pending on the host that renamed it (GCS was down). Merged, it
        would bring back a stale copy of the step beside the real one on every host
        (a 30-minute chaos run: a restarted host's listing did, and the hosts
        disagreed on the step)."""
        if name.endswith(_WITHDRAWN):
            other = self.ns.child(d, name[:-len(_WITHDRAWN)])
        else:
            other = self.ns.child(d, name + _WITHDRAWN)
        if other is None or other.ino in self._made:
            return False
        log.debug("not merging bucket object %s: %s is known here by its other name (a "
                 "withdrawal or reinstatement whose old objects are not deleted yet)", key,
                 self.ns.path_of(other))
        return True

    def _replace(self, d: Inode, name: bytes, old: Inode, obj: ObjectInfo) -> Inode:
        """A newer object written elsewhere replaces our persisted copy: a new inode
        (with the writeback cache the kernel trusts its own size of a file it has
        cached, so only a new file shows the new size)."""
        node, names = self.ns.replace_inode(old, object_guid(obj))
        for parent, gone in names:
            self.kernel.entry(parent.ino, gone)
        self.events.remote_removed(old)  # its data, its fetch and its inode go
        self._take_remote(node, obj, replaces=old.version)
        self.ns.persist(node)
        return node

    def _take_remote(self, node: Inode, obj: ObjectInfo, replaces: int = 0) -> None:
        self.versions.from_bucket(node, obj.size, obj.crc32c, replaces)
        node.mtime_ns = node.ctime_ns = int(obj.updated * 1e9)
        self.copies.elsewhere_only(node)
        self.copies.in_bucket(node, obj.generation)

    def _vanished(self, seen: set[int]) -> list[Inode]:
        """Files we knew as persisted whose objects are not in this listing."""
        return [node for node in self.ns.files()
                if node.ino not in seen and node.generation and node.linked]

    def _forget_vanished(self, seen: set[int]) -> None:
        """Files we knew as persisted whose objects are gone from the bucket."""
        for node in self._vanished(seen):
            if self._ghost(node):
                self._forget_ghost(node)
                continue
            self.copies.unpersisted(node)  # ours is now the only copy: persisted again
            if not (node.has_data or node.opens):
                log.warning("%s is gone from the bucket and not in RAM: removing it",
                            self.ns.path_of(node))
                for parent, name in self.ns.unlink_all(node):
                    self.kernel.entry(parent.ino, name)
                self.events.remote_removed(node)

    def _forget_ghosts(self, seen: set[int]) -> None:
        for node in self._vanished(seen):
            if self._ghost(node):
                self._forget_ghost(node)

    @staticmethod
    def _ghost(node: Inode) -> bool:
        """Known only from a bucket listing (here or on the host that announced it: no
        host ever stamped a change of it), with no copy anywhere but that object."""
        return (node.lamport == 0 and not node.writer and not node.holders
                and not node.has_data and not node.opens and not node.links)

    def _forget_ghost(self, node: Inode) -> None:
        log.warning("%s is gone from the bucket and nowhere else: removing it on every "
                    "host", self.ns.path_of(node))
        self._remove_ghost(node)

    def _remove_ghost(self, node: Inode) -> None:
        """Removed on every host (a tombstone: no host brings it back), and so is its
        directory when that was a ghost too, now empty."""
        parent = self._remove_everywhere(node)
        while (parent.ino != ROOT and not parent.children and parent.lamport == 0
               and not parent.writer):
            parent = self._remove_everywhere(parent)

    def _remove_everywhere(self, node: Inode) -> Inode:
        """Unlinked as a removal made here, which every host applies; returns its
        directory."""
        path = self.ns.path_of(node)
        parent = self.ns.inodes[node.parent]
        self.ns.unlink(parent, node.name)
        self.kernel.entry(parent.ino, node.name)
        self.events.removed(node, path)
        self.events.remote_removed(node)  # (the inode goes once the kernel lets go)
        return parent

    async def refresh_loop(self, pending_deletes: set[str]) -> None:
        while True:
            await trio.sleep(self.refresh)
            try:
                await self.load(pending_deletes, full=False)
            except (DurableError, OSError) as e:
                self._error(f"listing {self.tier.url}: {e}")

    def _error(self, msg: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = msg
        log.error("%s", msg)

    def status(self) -> dict[str, object]:
        return {
            "listed_objects": self.stats.listed_objects,
            "refresh_seconds": self.refresh,
            "last_listing_error": self.stats.last_error or None,
        }


def object_guid(obj: ObjectInfo) -> str:
    """The index id of a file known from the bucket: the same on every host that
    lists it, so hosts merging their listings agree on one entry."""
    return "gcs" + hashlib.sha256(f"{obj.key}\0{obj.generation}".encode()).hexdigest()[:29]
