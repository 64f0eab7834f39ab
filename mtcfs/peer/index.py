"""The replicated namespace index: every host keeps the metadata of every file
of the job, so lookups and listings never cross the network.

Each entry (file, directory, symlink) has a global id that survives renames,
and carries the stamp (lamport, writer) of its last change. A change is sent
as the entry's whole new state; a receiver applies it when its stamp is newer
than what it has (last writer wins by (lamport, node id)), so applying the
same change twice, or a snapshot over broadcasts, is harmless.

Because entries name their parent by id, not by path, a host's file that
arrives after the primary renamed the tmp directory it was written into lands
in the renamed directory (the Orbax multi-host commit). Two hosts that create
the same directory path concurrently (every torch DCP rank mkdirs the step)
get one merged directory: the later id becomes an alias of the local one. Every
entry of a merged directory carries its other ids, so a host that got the ids
apart (one of them renamed before the other reached it, or learned after a
restart) folds them into one directory there too.

Files are visible to other hosts once sealed (closed): the broadcast carries
size, crc32c, per-block crc32cs and the nodes holding that version.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mtcfs.core.copies import Copies
from mtcfs.core.namespace import CLOSED, ROOT, ROOT_GUID, Inode, Namespace
from mtcfs.core.versions import Versions
from mtcfs.peer.outbox import NOWHERE, Outbox
from mtcfs.peer.snapshots import RecentChanges, Snapshots
from mtcfs.peer.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)

MAX_PENDING = 100_000


@dataclass
class Stats:
    applied: int = 0
    ignored: int = 0
    conflicts: int = 0
    pending: int = 0


class Hooks:
    """What the index asks of the host around it (the FUSE layer, the RAM tier)."""

    def forget_data(self, node: Inode) -> None:
        """The node's local data is stale or gone: drop it from the RAM tier."""

    def invalidate(self, parent: Inode, name: bytes, node: Inode | None) -> None:
        """The kernel may cache this name (and node): make it look again."""

    def removed(self, node: Inode) -> None:
        """A remote change removed this node locally (unlinked; drop when unused)."""

    def attrs_changed(self, node: Inode) -> None:
        """A remote change updated this node's attributes: drop the kernel's copy."""

    def moved(self, node: Inode, old_path: str) -> None:
        """A remote change moved this node (a rename elsewhere) from `old_path`."""


_gc_pauses = 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a snapshot is applied (nested
    pauses: until the last ends). Its full passes walk every object the growing
    namespace holds: 20-35 % of applying 80,000 entries here. The applied entries
    make no cycles; any other cyclic garbage waits for the pause to end."""
    global _gc_pauses
    if _gc_pauses == 0 and not gc.isenabled():
        yield  # someone else turned it off: not ours to turn on
        return
    _gc_pauses += 1
    gc.disable()
    try:
        yield
    finally:
        _gc_pauses -= 1
        if _gc_pauses == 0:
            gc.enable()


@contextlib.contextmanager
def applying_snapshot(ns: Namespace) -> Iterator[None]:
    """While a snapshot (or a catch-up's changes) is applied: the collector paused
    (gc_paused) and the index's rows left for the store to write later
    (MetaStore.write_behind, written by mtcfs.peer.join.LaterRows)."""
    with gc_paused(), ns.store.write_behind():
        yield


def stamp_of(node: Inode) -> tuple[int, str]:
    return (node.lamport, node.writer)


def entry_stamp(e: pb.Entry) -> tuple[int, str]:
    return (e.lamport, e.writer)


def same_content(node: Inode, e: pb.Entry) -> bool:
    return Versions.same_content(node, e.version, e.size, e.crc32c if e.has_crc else None)


class DirectoryIds:
    """The ids a directory made at the same path on several hosts goes by: each other
    id (an alias) names our directory, and each of our directories knows its aliases
    (what its entries tell other hosts)."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # a remote directory's id -> our directory's id
        self.merged: dict[str, set[str]] = {}  # our directory's id -> its aliases

    def resolve(self, gid: str) -> str:
        return self.aliases.get(gid, gid)

    def others(self, gid: str) -> list[str]:
        return sorted(self.merged.get(gid, ()))

    def alias(self, other: str, gid: str) -> None:
        """`other` names our directory `gid` from now on (and so do the ids that named
        `other`)."""
        if other == gid or self.aliases.get(other) == gid:
            return
        self.unalias(other)
        self.aliases[other] = gid
        ids = self.merged.setdefault(gid, set())
        ids.add(other)
        for o in self.merged.pop(other, ()):
            self.aliases[o] = gid
            ids.add(o)

    def unalias(self, other: str) -> None:
        gid = self.aliases.pop(other, None)
        if gid is not None and gid in self.merged:
            self.merged[gid].discard(other)
            if not self.merged[gid]:
                del self.merged[gid]


def only_dropped(e: pb.Entry, dropped: str) -> pb.Entry:
    """`e` made to say only that `dropped` no longer holds (or serves) its file, with no
    holders or sources. A list of them would be the sender's view, perhaps older than
    the receiver's that has already heard of a drop, and the sets merge: each host
    told it holds what it had dropped answered with its own stale list, and hosts
    that had all evicted a file kept naming each other a holder, an announcement a
    second for ever (a chaos smoke never became quiet)."""
    del e.holders[:]
    del e.sources[:]
    e.dropped.append(dropped)
    return e


def first_hand(e: pb.Entry, source: str) -> pb.Entry:
    """`e` as `source`'s snapshot sends it: `source` knows whether it holds a copy, so a
    persisted file's entry that does not name it says it has none, as a drop would.
    Snapshot views merge as sets: without this, a host that missed a drop while it
    was away or starting took the holder back from the snapshot, for good. (Only
    persisted files: one whose holder came a moment after the snapshot was made
    would be taken for lost elsewhere; a persisted one is never lost.)"""
    if (e.version and e.persisted_version == e.version and source not in e.holders
            and source not in e.sources and source not in e.dropped):
        e.dropped.append(source)
    return e


def visible(node: Inode) -> bool:
    """Other hosts see directories, symlinks and sealed files (not ones being written)."""
    if not node.linked or node.ino == ROOT:
        return False
    return not node.is_file or (node.state == CLOSED and node.version > 0)


def directories_above(ns: Namespace, node: Inode) -> list[Inode]:
    """The visible directories above `node`, outermost first."""
    out, d = [], ns.inodes.get(node.parent)
    while d is not None and d.ino != ROOT:
        out += [d] if visible(d) else []
        d = ns.inodes.get(d.parent)
    return out[::-1]


class ReplicatedIndex:
    def __init__(self, ns: Namespace, node_id: str, hooks: Hooks | None = None,
                 copies: Copies | None = None, now: Callable[[], float] | None = None,
                 outbox: Outbox = NOWHERE) -> None:
        self.ns = ns
        self.now = now if now is not None else time.monotonic  # for change times
        self.node_id = node_id
        self.hooks = hooks or Hooks()
        self.copies = copies or Copies(node_id, ns=ns)  # where copies are: their one owner
        self.tombstones: dict[str, tuple[int, str, float]] = {
            g: (lam, w, t) for g, lam, w, t in ns.store.load_tombstones()
        }
        self.ids = DirectoryIds()  # directories made on several hosts: their other ids
        self.pending: dict[str, list[pb.Entry]] = {}  # parent id -> entries waiting for it
        self.clock = max([n.lamport for n in ns.inodes.values()]
                         + [lam for lam, _, _ in self.tombstones.values()] + [0])
        self.stats = Stats()
        self.recent = RecentChanges(self.now, len(ns.inodes) <= 1 and not self.tombstones)
        # Where this host's changes go (the broadcaster takes them from there).
        self.outbox = outbox
        self.touched: list[Inode] = []  # nodes the last apply() created or changed
        # Nodes the last apply() said this host holds, which it does not: the tier
        # announces that (a replacement host with the same node id has none).
        self.disowned: list[Inode] = []

    # -- local changes -------------------------------------------------------------

    def tick(self, seen: int = 0) -> int:
        self.clock = max(self.clock, seen) + 1
        return self.clock

    def changed(self, *nodes: Inode) -> None:
        """Local changes to `nodes` (created, sealed, moved, attributes): stamp and send."""
        out = []
        with self.ns.store.transaction():
            for node in nodes:
                if not self.visible(node):
                    continue
                node.lamport, node.writer = self.tick(), self.node_id
                self.ns.persist(node)
                self.recent.note(node.guid)
                out.append(self.entry_of(node))
        if out:
            self.outbox.supersede(out)
            self.outbox.put(out)

    def removed(self, node: Inode) -> None:
        """A local unlink/rmdir, or the target a rename replaced."""
        if not node.guid or node.guid == ROOT_GUID:
            return
        lam = self.tick()
        self._tombstone(node.guid, lam, self.node_id)
        self.recent.note(node.guid)
        self.outbox.put([pb.Entry(id=node.guid, lamport=lam, writer=self.node_id, removed=True)])

    def holders_changed(self, node: Inode, dropped: str = "", at_once: bool = False) -> None:
        """Copies of this version came (or, `dropped`, one was evicted). Holders merge
        as a set, so no new stamp is needed, and a removal travels as its own list."""
        if self.visible(node):
            self.recent.note(node.guid)
            e = self.entry_of(node)
            if dropped:
                only_dropped(e, dropped)
            (self.outbox.put if at_once else self.outbox.announce)([e])

    def announce_replicas_of(self, writer: str) -> None:
        """`writer` died or restarted: announce at once the replicas of its files held
        here, and their directories (parents first), since its announcement of them,
        or even its change (a small file's waits for its copies), may have died with
        it (they wait: mtcfs.peer.outbox)."""
        nodes = self.copies.replicas_from(writer)
        above = {d.ino: d for n in nodes for d in directories_above(self.ns, n)}
        self.outbox.put([self.entry_of(d) for d in above.values()])
        for node in nodes:
            self.holders_changed(node, at_once=True)

    def sources_changed(self, node: Inode, dropped: str = "") -> None:
        """This host began or stopped serving a persisted file it reads through. Its
        directories go first: made from the bucket listing, they have an id of this
        host's own, which the others merge with theirs (as concurrent mkdirs)."""
        if not self.visible(node):
            return
        out = []
        for d in directories_above(self.ns, node):
            self.recent.note(d.guid)
            out.append(self.entry_of(d))
        self.recent.note(node.guid)
        e = self.entry_of(node)
        if dropped:
            only_dropped(e, dropped)
        self.outbox.put([*out, e])

    def publish_ancestors(self, node: Inode) -> None:
        """Send `node`'s directories again where another host made them: a peer that
        has not heard of them yet (the other host's broadcast is still on its way)
        could not apply this host's change below them before it does."""
        out = [self.entry_of(d) for d in directories_above(self.ns, node)
               if d.writer and d.writer != self.node_id]
        if out:
            self.outbox.put(out)  # parents first

    visible = staticmethod(visible)

    def entry_of(self, node: Inode) -> pb.Entry:
        parent = self.ns.inodes[node.parent]
        e = pb.Entry(
            id=node.guid, parent=parent.guid, name=node.name, mode=node.mode, uid=node.uid,
            gid=node.gid, mtime_ns=node.mtime_ns, ctime_ns=node.ctime_ns,
            size=node.size, version=node.version,
            # A copy read through here is a cache copy: announced as a source, never as
            # a holder (it must not count as a replica anywhere).
            holders=[h for h in node.holders if h != self.node_id or not node.cached],
            sources=node.sources,
            lamport=node.lamport, writer=node.writer, author=node.author,
            persisted_version=node.persisted_version, generation=node.generation,
            rdev=node.rdev,
        )
        if node.target is not None:
            e.target = node.target
        if node.crc32c is not None and node.is_file:
            e.has_crc, e.crc32c = True, node.crc32c
        if node.block_crcs is not None:
            e.block_crcs = node.block_crcs
        if node.is_dir:
            e.merged_ids.extend(self.ids.others(node.guid))
        for p, n in node.links:
            e.links.append(pb.Link(parent=self.ns.inodes[p].guid, name=n))
        return e

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> Iterator[pb.Entry]:
        """Every visible entry, parents before children, then the tombstones."""
        return Snapshots(self).whole()

    def snapshot_pieces(self, size: int) -> Iterator[list[pb.Entry]]:
        """The snapshot in pieces of at most `size` entries (mtcfs.peer.snapshots)."""
        return Snapshots(self).pieces(size)

    def delta_pieces(self, since_s: float, size: int) -> Iterator[list[pb.Entry]] | None:
        """What changed here in the last `since_s` seconds, in pieces; None when this
        index cannot tell (mtcfs.peer.snapshots)."""
        return Snapshots(self).delta(since_s, size)

    # -- remote changes --------------------------------------------------------------

    def apply(self, entries: list[pb.Entry]) -> int:
        """Apply a batch from a peer (in the trio thread). Returns how many changed us."""
        applied = 0
        self.touched = []
        self.disowned = []
        # Coalesced: each inode and name written once per batch, in a few statements.
        with self.ns.store.transaction(coalesce=True):
            for e in entries:
                if e.lamport > self.clock:
                    self.clock = e.lamport
                if self._apply_one(e):
                    applied += 1
        self.stats.applied += applied
        self.stats.pending = sum(len(v) for v in self.pending.values())
        return applied

    def is_pending(self, guid: str) -> bool:
        return any(e.id == guid for waiting in self.pending.values() for e in waiting)

    def resolve(self, gid: str) -> str:
        return self.ids.resolve(gid)

    def _apply_one(self, e: pb.Entry) -> bool:
        if self._apply_entry(e):
            self.recent.note(self.resolve(e.id))
            return True
        return False

    # (The path below runs once per entry of every batch and snapshot, hundreds of
    # thousands of times when a host joins a large job: lookups are inlined.)
    def _apply_entry(self, e: pb.Entry) -> bool:
        aliases = self.ids.aliases
        eid = e.id
        gid = aliases.get(eid, eid)
        if gid != eid and ((merged := self.ns.by_global_id(gid)) is None or not merged.linked):
            # The directory it merged with is gone: the id stands for itself again (else
            # each change of it made one more node with that id).
            self.ids.unalias(eid)
            gid = eid
        tomb = self.tombstones.get(gid)
        if tomb is not None and (tomb[0], tomb[1]) >= entry_stamp(e):
            self.stats.ignored += 1
            return False
        if e.removed:
            return self._apply_removal(gid, e)
        by_guid, inodes = self.ns.by_guid, self.ns.inodes
        pid = e.parent
        pid = aliases.get(pid, pid)
        ino = by_guid.get(pid)
        parent = None if ino is None else inodes.get(ino)
        if parent is None or not parent.linked or parent.children is None:
            # Its directory has not reached us yet: apply when it does.
            if sum(len(v) for v in self.pending.values()) < MAX_PENDING:
                self.pending.setdefault(pid, []).append(e)
            return False
        ino = by_guid.get(gid)
        node = None if ino is None else inodes.get(ino)
        if node is not None and node.linked:
            done = self._update(node, parent, e)
        else:
            done = self._create(parent, e)
        return done

    def _apply_removal(self, gid: str, e: pb.Entry) -> bool:
        self._tombstone(gid, e.lamport, e.writer)
        node = self.ns.by_global_id(gid)
        if node is None or not node.linked:
            return False
        if stamp_of(node) > entry_stamp(e):
            return False  # changed here after the removal was decided: keep it
        if node.is_dir and node.children:
            self.stats.conflicts += 1
            log.warning("keeping %s: removed by %s but not empty here", self.ns.path_of(node),
                        e.writer)
            return False
        self._unlink(node)
        return True

    def _unlink(self, node: Inode) -> None:
        """Every name of the node goes (a removal, or new content elsewhere)."""
        for parent, name in self.ns.unlink_all(node):
            self.hooks.invalidate(parent, name, node)
        self.hooks.removed(node)

    def _take_name(self, parent: Inode, name: bytes, node: Inode) -> None:
        """A remote change puts something else at `name`: `node` loses that name (a
        hard-linked node keeps its others)."""
        self.ns.unlink(parent, name)
        self.hooks.invalidate(parent, name, node)
        if node.linked:
            self.hooks.attrs_changed(node)
        else:
            self.hooks.removed(node)

    def _tombstone(self, gid: str, lam: int, writer: str) -> None:
        old = self.tombstones.get(gid)
        if old is None or (old[0], old[1]) < (lam, writer):
            now = time.time()
            self.tombstones[gid] = (lam, writer, now)
            self.ns.store.put_tombstone(gid, lam, writer, now)

    def _create(self, parent: Inode, e: pb.Entry) -> bool:
        name, mode = e.name, e.mode
        assert parent.children is not None
        ino = parent.children.get(name)
        existing = None if ino is None else self.ns.inodes[ino]
        if existing is not None:
            if existing.is_dir and stat.S_ISDIR(e.mode):
                # The same directory made on two hosts: one directory, two ids.
                self.ids.alias(e.id, existing.guid)
                if entry_stamp(e) > stamp_of(existing):
                    self._set_attrs(existing, e)
                    self.ns.persist(existing)
                self._release_pending(e.id)
                self._merge_ids(existing, e)
                return True
            if (stamp_of(existing) >= entry_stamp(e) or existing.opens and existing.dirty
                    or existing.is_dir and existing.children):
                # (A directory with entries keeps its name: taking it would orphan them.)
                self.stats.conflicts += 1
                log.info("name conflict at %s: keeping ours over %s's",
                         self.ns.path_of(existing), e.writer)
                return False
            if existing.lamport:  # not merely known from the bucket listing
                self.stats.conflicts += 1
            self._take_name(parent, e.name, existing)
        node = self.ns.new_inode(parent, name, mode, e.uid, e.gid,
                                 target=e.target if stat.S_ISLNK(mode) else None,
                                 rdev=e.rdev, global_id=e.id)
        self._set_attrs(node, e)
        if stat.S_ISREG(mode):
            node.has_data = False  # new here: no data of it to forget
            self._set_content(node, e)
        if e.links:
            self._sync_links(node, e)
        self.ns.persist(node)
        self.touched.append(node)
        self.hooks.invalidate(parent, name, None)
        if node.is_dir:
            self._release_pending(e.id)
            self._merge_ids(node, e)
        return True

    def _update(self, node: Inode, parent: Inode, e: pb.Entry) -> bool:
        # (Whatever the stamps: that the ids name one directory never goes stale.)
        merged = node.is_dir and self._merge_ids(node, e)
        if stamp_of(node) >= entry_stamp(e):
            if merged:
                self.touched.append(node)
                return True
            if stamp_of(node) == entry_stamp(e):
                self._sync_links(node, e)  # e.g. a link's directory arrived meanwhile
            if node.is_file and same_content(node, e):
                return self._merge_holders(node, e)
            self.stats.ignored += 1
            return False
        if node.is_file and node.dirty:
            return False  # being rewritten here: our seal will be newer
        if node.parent != parent.ino or node.name != e.name:
            if node.is_dir and self.ns.is_ancestor(node, parent):
                self.stats.conflicts += 1
                log.warning("ignoring a move of %s into itself from %s", self.ns.path_of(node),
                            e.writer)
                return False
            existing = self.ns.child(parent, e.name)
            if existing is not None and existing is not node:
                if existing.is_dir and node.is_dir and not self.ns.is_ancestor(existing, node):
                    # Two directories at one name are one (as two hosts' mkdirs of it).
                    self.stats.conflicts += 1
                    self._fold(existing, node)
                elif existing.is_dir and existing.children:
                    self.stats.conflicts += 1
                    return False
                else:
                    self._take_name(parent, e.name, existing)
            self._move(node, self.ns.inodes[node.parent], node.name, parent, e.name)
        if node.is_file and not same_content(node, e):
            node = self._replace(node, e)
        else:
            self.hooks.attrs_changed(node)
        self._set_attrs(node, e)
        if node.is_file:
            self._set_content(node, e)
        self._sync_links(node, e)
        self.ns.persist(node)
        self.touched.append(node)
        return True

    def _sync_links(self, node: Inode, e: pb.Entry) -> None:
        """Make the node's further names (hard links) those of the entry."""
        if node.is_dir or (not e.links and not node.links):
            return
        want: list[tuple[int, bytes]] = []
        for link in e.links:
            d = self.ns.by_global_id(self.resolve(link.parent))
            if d is None or not d.linked or not d.is_dir:
                # That directory has not reached us yet: try again when it does.
                if sum(len(v) for v in self.pending.values()) < MAX_PENDING:
                    self.pending.setdefault(self.resolve(link.parent), []).append(e)
                continue
            want.append((d.ino, link.name))
        changed = False
        for p, n in list(node.links):
            if (p, n) not in want:
                d = self.ns.inodes[p]
                self.ns.unlink(d, n)
                self.hooks.invalidate(d, n, node)
                changed = True
        for p, n in want:
            if (p, n) in node.links or (p, n) == (node.parent, node.name):
                continue
            d = self.ns.inodes[p]
            existing = self.ns.child(d, n)
            if existing is not None:
                if existing.is_dir or stamp_of(existing) >= entry_stamp(e):
                    self.stats.conflicts += 1
                    continue
                self._take_name(d, n, existing)
            self.ns.link(node, d, n)
            self.hooks.invalidate(d, n, None)
            changed = True
        if changed:
            self.hooks.attrs_changed(node)  # nlink

    def _merge_holders(self, node: Inode, e: pb.Entry) -> bool:
        """Same version: holders merge as a set, and a persisted flag is taken."""
        changed, disowned = self.copies.merge(node, e.holders, e.dropped, e.persisted_version,
                                              e.generation, e.sources)
        if disowned:
            self.disowned.append(node)
        for h in e.dropped:  # (what waits here to leave must not name it again)
            self.outbox.dropped(node.guid, h)
        if changed:
            self.touched.append(node)
        return changed

    def _replace(self, old: Inode, e: pb.Entry) -> Inode:
        """New content written elsewhere. A new inode: with the writeback cache the
        kernel trusts its own size of a file it has cached."""
        node, names = self.ns.replace_inode(old, e.id)
        for parent, name in names:
            self.hooks.invalidate(parent, name, old)
        self.hooks.removed(old)
        return node

    @staticmethod
    def _set_attrs(node: Inode, e: pb.Entry) -> None:
        node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(e.mode)
        node.uid, node.gid = e.uid, e.gid
        node.mtime_ns, node.ctime_ns = e.mtime_ns, e.ctime_ns
        node.lamport, node.writer = e.lamport, e.writer

    def _set_content(self, node: Inode, e: pb.Entry) -> None:
        version, size, crc = e.version, e.size, e.crc32c if e.has_crc else None
        fresh = not Versions.same_content(node, version, size, crc)
        # (Versions' rules need nothing of this host: no instance of its own here.)
        Versions.adopted(node, version, size, crc,
                         e.block_crcs or None,  # (each read of it is a copy)
                         e.author or e.writer)  # (a peer of an older version: its stamp)
        if fresh and node.has_data:
            self.hooks.forget_data(node)
        if self.copies.take_version(node, e.holders, e.persisted_version, e.generation, fresh,
                                    e.sources):
            self.disowned.append(node)

    # -- directories known by several ids ---------------------------------------------

    def _merge_ids(self, node: Inode, e: pb.Entry) -> bool:
        """The entry's ids of `node` (a directory): each becomes an alias of it, and one
        that is a directory of its own here is folded into it. True when that changed
        the tree here."""
        folded = False
        for gid in (e.id, *e.merged_ids):
            other = self.ns.by_global_id(self.resolve(gid))
            if other is node:
                continue
            if other is not None and other.linked:
                if (not other.is_dir or self.ns.is_ancestor(other, node)
                        or self.ns.is_ancestor(node, other)):
                    self.stats.conflicts += 1
                    log.warning("not merging %s into %s: not two sibling directories",
                                self.ns.path_of(other), self.ns.path_of(node))
                    continue
                self._fold(other, node)
                folded = True
            else:
                self.ids.alias(gid, node.guid)
            self._release_pending(gid)
        return folded

    def _fold(self, src: Inode, dst: Inode) -> None:
        """Directory `src` is `dst` under another id: its entries move into `dst` (a
        name in both: two directories merge, else the newer change keeps the name), it
        goes, and its ids name `dst`."""
        log.info("merging %s into %s: one directory made on several hosts",
                 self.ns.path_of(src), self.ns.path_of(dst))
        for name, ino in list((src.children or {}).items()):
            child = self.ns.inodes[ino]
            existing = self.ns.child(dst, name)
            if existing is not None and existing.is_dir and child.is_dir:
                self._fold(child, existing)
                continue
            if existing is not None:
                self.stats.conflicts += 1
                if stamp_of(existing) >= stamp_of(child):
                    self._take_name(src, name, child)
                    continue
                self._take_name(dst, name, existing)
            self._move(child, src, name, dst, name)
            self.touched.append(child)
        parent = self.ns.inodes[src.parent]
        self.ns.unlink(parent, src.name)
        self.hooks.invalidate(parent, src.name, src)
        self.hooks.removed(src)
        self.ids.alias(src.guid, dst.guid)
        self.touched.append(dst)

    def _move(self, node: Inode, old_parent: Inode, old_name: bytes, parent: Inode,
              name: bytes) -> None:
        """A rename applied here: `node` from `old_name` in `old_parent` to `name` in
        `parent` (a name there was taken aside before), and the kernel told of both."""
        old_path = self.ns.path_of(node)
        self.ns.rename(old_parent, old_name, parent, name)
        self.hooks.invalidate(old_parent, old_name, node)
        self.hooks.invalidate(parent, name, None)
        self.hooks.moved(node, old_path)

    def _release_pending(self, gid: str) -> None:
        waiting = self.pending.pop(gid, [])
        for e in waiting:
            self._apply_one(e)

    # -- status ----------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        return {
            "clock": self.clock,
            "entries": len(self.ns.inodes) - 1,
            "tombstones": len(self.tombstones),
            "applied": self.stats.applied,
            "ignored": self.stats.ignored,
            "conflicts": self.stats.conflicts,
            "pending": self.stats.pending,
            "recent": len(self.recent),
        }

