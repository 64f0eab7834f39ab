"""Withdrawing a committed step that lost the last copy of one of its files.

With `--fsync local` (the default) a host that dies right after closing a shard
can take the only copy with it. Its step's commit marker is then a lie: every
host would show the step as the newest, a restarting job would pick it, fail on
the lost shard and crash-loop. So when a file of a committed step has no copy
left — no live host holds it and it is not persisted — the step is withdrawn:
its commit markers are renamed to `<marker>.mtcfs-withdrawn` and the step
directory to `<name>.mtcfs-withdrawn` (Orbax on POSIX commits by the directory's
name), on every host, through the filesystem like any rename. No framework reads
those names, so its own "latest step" logic lands on the newest intact step.
The evidence stays (files and names; the lost files are the ones without a
copy) and `mtcfs steps` shows it on every host, since it is read from the
names; should a lost file come back (its holder rejoins with its RAM intact),
the step is reinstated under its own names (only when every file seen lost in it
is back, and every file of it is in the bucket or in the acting host's RAM: one
removed meanwhile keeps it withdrawn, and so does a stale holder entry).

A holder counts as gone only once it has been down for 15 s (membership.GONE_AFTER)
as this host sees it: a frozen daemon, a cut link or a daemon restarting over
its intact RAM dir comes back with its copies within that, and a withdrawal
meanwhile would rename a healthy step back and forth (and split it when the
other side of a cut renamed too). A restarting job that reads the step in that
window finds the lost shard missing and restarts once more.

One host acts (the live host with the smallest node id): every host computes
the same choice from the same index. Only a host that sees at least half of the
job's hosts alive (itself included) acts: a host cut off from the others sees
them all dead, and must not withdraw the steps they still hold (with two hosts a
dead peer and a cut link look alike, and either may act; renames made on both
sides merge when the link heals).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from mtcfs.core.copies import Copies
from mtcfs.core.events import Listener
from mtcfs.core.namespace import ROOT
from mtcfs.core.steps import StepRules, all_steps, files_under
from mtcfs.fs.filesystem import FsError
from mtcfs.tiers.durable import DurableError, DurableTier

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode
    from mtcfs.fs.filesystem import Filesystem

log = logging.getLogger(__name__)

SUFFIX = ".mtcfs-withdrawn"
_SUFFIX = SUFFIX.encode()
# A pass runs when peers come or go, when a change could matter (a copy dropped, a
# file without a copy, a directory, a marker), when a grace ends, and this often (then
# looking at every directory again: the safety net). A pass reads the whole index on
# the acting host: at 240,010 entries a scan of every directory takes about 60 ms.
INTERVAL = 60.0
REINSTATE_AFTER = 10.0  # seconds every file of a withdrawn step must have had a copy
LANDED_TIMEOUT = 20.0  # seconds a lost file's look in the bucket may take
# Seconds after peers changed (one restarted or was replaced, this host started)
# before a file with no known copy counts as lost: the holders of a restarted
# writer's replicas announce them again at once (its own word of them may have died
# with it), and that may still be on its way. A chaos run withdrew a step whose
# marker a peer held, 0.25 s after the writer's replacement started.
SETTLE = 3.0


class Withdrawal(Listener):
    """Acts through the filesystem (`fs`): its renames are renames on the mount,
    which every host hears of. `live_nodes`: the node ids of the live peers;
    `down_for(node_id)`: seconds since that node was last seen alive; `gone_after`:
    how long every holder of a lost file must have been down (membership's bound).
    `durable`: where a lost file's upload may have landed unrecorded (mtcfs.absent's
    NoDurable without a bucket)."""

    def __init__(self, fs: Filesystem, copies: Copies, durable: DurableTier, rules: StepRules,
                 live_nodes: Callable[[], list[str]], job_size: Callable[[], int],
                 down_for: Callable[[str], float], gone_after: float) -> None:
        self.fs = fs
        self.copies = copies
        self.durable = durable
        self.landed = 0  # lost files found in the bucket (uploads whose record was lost)
        self._peers_changed_at = time.monotonic()  # (starting is a change too)
        self.rules = rules
        self.live_nodes = live_nodes
        self.down_for = down_for
        self.gone_after = gone_after
        self.job_size = job_size  # hosts of the job, this one included, live or not
        self.withdrawn = 0
        self.reinstated = 0
        self._wake = trio.Event()
        self._recovering: dict[int, float] = {}  # withdrawn step dir -> whole again since
        # Withdrawn step dir -> the global ids of the files seen lost in it (by this
        # host, acting or not): it is reinstated only once each of them is back. A lost
        # file removed meanwhile (retention of an old step, a user) stays missing.
        self._lost_in: dict[int, set[str]] = {}
        self._wake_at = math.inf  # a pass due then (a grace ends)
        # Directories that may hold renamed markers (a name ending in SUFFIX was seen
        # in them): what a pass looks at instead of every directory. None: look at
        # every directory at the next pass (the first, and then every INTERVAL).
        self._candidates: set[int] | None = None
        self._rescan_at = 0.0
        # Observers (metrics): called once per step withdrawn.
        self.observers: list[Callable[[], None]] = []

    # -- events (Listener): a copy may have gone, or come back -------------------------------

    def peers_changed(self) -> None:
        self._peers_changed_at = time.monotonic()
        self._wake.set()

    def remote_changed(self, nodes: list[Inode]) -> None:
        self._note_names(nodes)
        # (A save's files, each with a live holder, change nothing a pass decides: on
        # a large job a pass per batch would read the whole index many times a save.)
        if self._watching() or any(self._matters(n) for n in nodes):
            self._wake.set()

    def renamed(self, node: Inode, old_path: str) -> None:
        self._note_names([node])
        if self._watching() or self._matters(node):
            self._wake.set()

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        if dropped or self._watching() or self.lost(node):
            self._wake.set()

    def persisted(self, node: Inode) -> None:
        # (A lost file of a withdrawn step found in the bucket by this host's listing:
        # its uploader's word of it then changes nothing here, and wakes nothing.)
        if self._watching():
            self._wake.set()

    def _note_names(self, nodes: list[Inode]) -> None:
        if self._candidates is not None:
            for n in nodes:
                if n.name.endswith(_SUFFIX):
                    self._candidates.add(n.parent)

    def _matters(self, node: Inode) -> bool:
        """A change of `node` that could change what a pass decides (with no step
        withdrawn): a directory (a step made, renamed, committed by its name), a
        marker, or a file without a copy."""
        return (node.is_dir or node.name.endswith(_SUFFIX)
                or self.rules.is_marker_name(node.name) or self.lost(node))

    def _watching(self) -> bool:
        """A step is withdrawn, or a file seen lost: any change may bring it back."""
        return bool(self._candidates or self._lost_in or self._wake_at < math.inf)

    async def run(self) -> None:
        while True:
            with trio.move_on_after(max(0.0, min(INTERVAL,
                                                 self._wake_at - trio.current_time()))):
                await self._wake.wait()
            self._wake_at = math.inf
            self._wake = trio.Event()
            await trio.sleep(0.2)  # coalesce a burst of changes (a host's many files)
            try:
                await self.pass_once()
            except Exception:  # a bug here must not take the mount down
                log.exception("withdrawal pass failed")

    # -- deciding ------------------------------------------------------------------------

    def acting(self) -> bool:
        """This host is the one that renames: the smallest live node id, on the side
        of a partition that holds at least half of the job's hosts."""
        live = self.live_nodes()
        if 2 * (len(live) + 1) < self.job_size():
            return False
        return self.copies.node_id <= min(live, default=self.copies.node_id)

    def lost(self, f: Inode) -> bool:
        return self.copies.lost(f)

    def gone_in(self, f: Inode) -> float:
        """Seconds until `f` counts as gone for good: 0 once it has, inf while a copy
        is reachable (its holders may still come back before then)."""
        if not self.lost(f):
            return math.inf
        waits = [self.gone_after - self.down_for(h) for h in f.holders
                 if h != self.copies.node_id]
        return max([0.0, *waits])

    async def pass_once(self) -> None:
        # (Withdrawn before this pass: one withdrawn in it has lost files, nothing to
        # reinstate yet.)
        withdrawn = self._withdrawn_dirs()
        self._note_lost(withdrawn)
        if not self.acting():
            return
        ns = self.fs.ns
        now = trio.current_time()
        for d in all_steps(ns, self.rules):
            if (not self.rules.is_committed_step(ns, d) or d.name.endswith(_SUFFIX)
                    or self._inside_step(d)):
                continue
            lost = []
            for f in files_under(ns, d):
                wait = self.gone_in(f)
                if wait == 0:
                    lost.append(f)
                elif wait < math.inf:
                    self._wake_at = min(self._wake_at, now + wait)
            settled_in = self._peers_changed_at + SETTLE - time.monotonic()
            if lost and settled_in > 0:
                self._wake_at = min(self._wake_at, now + settled_in)
                continue  # their holders' word may be on its way: look again then
            if lost:
                lost = [f for f in lost if not await self._landed(f)]
            if lost and all(self.lost(f) for f in lost):
                await self._withdraw(d, lost)
        recovering = {}
        for d in withdrawn:
            files = list(files_under(ns, d))
            if (any(self.lost(f) for f in files) or self._still_missing(d)
                    or not all(f.persisted or f.has_data for f in files)):
                # (Back means in the bucket or in this host's RAM: a holder entry may be
                # stale, e.g. a host replaced by an empty one whose "I hold none of
                # these" has not reached us; a chaos run reinstated a step on one.)
                continue
            # A host replaced by an empty one under the same node id is live again
            # before its "I hold none of these" reaches us: its old holder entries
            # make the lost files look back. Reinstated only once that has held for
            # a while, so a withdrawal does not flap (each flap renames the step's
            # objects in the bucket back and forth).
            since = recovering[d.ino] = self._recovering.get(d.ino, now)
            if now - since >= REINSTATE_AFTER:
                del recovering[d.ino]
                await self._reinstate(d)
            else:
                self._wake_at = min(self._wake_at, since + REINSTATE_AFTER)
        self._recovering = recovering

    async def _landed(self, f: Inode) -> bool:
        """Whether lost `f` is in the bucket after all: its uploader died after the
        upload landed and before the record of it reached any other host. An object
        under its name with its size and crc32c is that copy: recorded as persisted
        (and announced), so the step keeps its names. Unreachable bucket: not found."""
        if not self.durable.url or f.crc32c is None:
            return False
        ns = self.fs.ns
        path, version = ns.path_of(f), f.version
        info = None
        with trio.move_on_after(LANDED_TIMEOUT):
            try:
                info = await trio.to_thread.run_sync(self.durable.stat, path,
                                                     abandon_on_cancel=True)
            except (DurableError, OSError, ValueError) as e:
                log.warning("%s has no copy on any host; looking for it in %s: %s", path,
                            self.durable.url, e)
        if info is None or info.size != f.size or info.crc32c != f.crc32c:
            return False
        if not f.linked or f.version != version or ns.path_of(f) != path or not self.lost(f):
            return False  # changed while we looked: the next pass looks again
        self.copies.persisted(f, info.generation, version)
        self.landed += 1
        log.warning("%s has no copy on any host, but its upload had landed (%s, generation "
                    "%d, crc32c %08x): kept, served from there", path, self.durable.url,
                    info.generation, info.crc32c)
        return True

    def _withdrawn_dirs(self) -> list[Inode]:
        ns = self.fs.ns
        now = trio.current_time()
        if self._candidates is None or now >= self._rescan_at:
            self._rescan_at = now + INTERVAL
            found = [n for n in list(ns.inodes.values()) if n.linked and self.is_withdrawn(n)]
        else:
            found = [d for ino in self._candidates
                     if (d := ns.inodes.get(ino)) is not None and d.linked
                     and self.is_withdrawn(d)]
        self._candidates = {d.ino for d in found}
        return found

    def _note_lost(self, withdrawn: list[Inode]) -> None:
        ns = self.fs.ns
        inos = {d.ino for d in withdrawn}
        for ino in [i for i in self._lost_in if i not in inos]:
            del self._lost_in[ino]
        for d in withdrawn:
            lost = {f.guid for f in files_under(ns, d) if f.guid and self.lost(f)}
            if lost:
                self._lost_in.setdefault(d.ino, set()).update(lost)

    def _still_missing(self, d: Inode) -> bool:
        """A file seen lost in withdrawn `d` is not back in it (removed, or still
        without a copy)."""
        ns = self.fs.ns
        for gid in self._lost_in.get(d.ino, ()):
            f = ns.by_global_id(gid)
            if f is None or not f.linked or not ns.is_ancestor(d, f) or self.lost(f):
                return True
        return False

    def _inside_step(self, d: Inode) -> bool:
        """`d` lies inside a committed or withdrawn step (Orbax's item directories carry
        markers of their own): the outermost step is the one withdrawn."""
        ns = self.fs.ns
        node = ns.inodes[d.parent]
        while node.ino != ROOT:
            if self.rules.is_committed_step(ns, node) or self.hidden_markers(node):
                return True
            node = ns.inodes[node.parent]
        return False

    def hidden_markers(self, d: Inode) -> list[bytes]:
        """The commit markers withdrawal renamed in directory `d`."""
        return [n for n in (d.children or {}) if n.endswith(_SUFFIX)
                and self.rules.is_marker_name(n[:-len(_SUFFIX)])]

    # -- acting --------------------------------------------------------------------------

    async def _withdraw(self, d: Inode, lost: list[Inode]) -> None:
        ns = self.fs.ns
        path = ns.path_of(d)
        names = [ns.path_of(f) for f in lost]
        guids = {f.guid for f in lost if f.guid}
        markers = [name for name in list(d.children or {}) if self.rules.is_marker_name(name)]
        for name in markers:
            await self._rename(d, name, d, name + _SUFFIX)  # (renamed: a candidate now)
        parent = ns.inodes[d.parent]
        if d.name + _SUFFIX not in (parent.children or {}):
            await self._rename(parent, d.name, parent, d.name + _SUFFIX)
        if guids:
            self._lost_in.setdefault(d.ino, set()).update(guids)
        self.withdrawn += 1
        for observe in self.observers:
            observe()
        log.error("withdrew step %s: %d file(s) lost their last copy (%s); its commit "
                  "marker(s) %s and the step directory are now named *%s, so that a "
                  "restarting job resumes from the newest intact step", path, len(names),
                  ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
                  ", ".join(m.decode("utf-8", "surrogateescape") for m in markers), SUFFIX)

    async def _reinstate(self, d: Inode) -> None:
        ns = self.fs.ns
        parent = ns.inodes[d.parent]
        if d.name.endswith(_SUFFIX):
            original = d.name[:-len(_SUFFIX)]
            if original in (parent.children or {}):
                return  # the job has saved that step again meanwhile: keep the evidence
            await self._rename(parent, d.name, parent, original)
        for hidden in self.hidden_markers(d):
            if hidden[:-len(_SUFFIX)] not in (d.children or {}):
                await self._rename(d, hidden, d, hidden[:-len(_SUFFIX)])
        self.reinstated += 1
        log.warning("reinstated step %s: every file has a copy again", ns.path_of(d))

    async def _rename(self, p1: Inode, n1: bytes, p2: Inode, n2: bytes) -> None:
        """A rename as if made through the mount, which the kernel did not see."""
        try:
            await self.fs.rename(p1.ino, n1, p2.ino, n2, 0)
        except FsError as e:
            log.warning("withdrawal: renaming %r failed: errno %d", n1, e.errno)
            return
        self.fs.kernel.entry(p1.ino, n1)
        self.fs.kernel.entry(p2.ino, n2)

    # -- reporting -------------------------------------------------------------------------

    def is_withdrawn(self, d: Inode) -> bool:
        """`d` is a withdrawn step directory (its markers renamed aside)."""
        return d.is_dir and bool(self.hidden_markers(d))

    def status(self) -> dict[str, object]:
        return {"withdrawn_steps": self.withdrawn, "reinstated_steps": self.reinstated,
                "lost_files_found_in_bucket": self.landed,
                "withdrawn_now": len(self._withdrawn_dirs())}
