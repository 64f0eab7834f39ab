"""Retention (--keep-steps N): the newest N complete steps stay in RAM; older
steps leave RAM on every host once persisted (metadata stays, reads go to the
bucket); incomplete steps older than the newest complete one are removed
after a grace period.

Every host runs this on its own copy of the replicated index, so each drops
its own copies (own data, replicas, caches) of the same steps without any
coordination. A copy leaves only once the file is persisted: that is the one
copy retention relies on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from mtcfs.core.events import Listener
from mtcfs.core.namespace import OPEN, ROOT
from mtcfs.core.retired import RetiredSteps
from mtcfs.core.steps import StepRules, dirs_under, files_under, step_number
from mtcfs.lifecycle.space import SpaceManager, step_view
from mtcfs.lifecycle.withdrawal import SUFFIX as WITHDRAWN_SUFFIX

if TYPE_CHECKING:
    from mtcfs.core.namespace import Inode
    from mtcfs.fs.filesystem import Filesystem

log = logging.getLogger(__name__)

# A pass runs after seals/persists/evictions (kicked) and at least this often
# (the grace period of incomplete steps is a matter of time passing).
INTERVAL = 10.0


class Retention(Listener):
    """Acts through the filesystem (`fs`): a removed step is removed as if by rm -r
    on the mount, so uploads, peers and the kernel's caches hear of it."""

    def __init__(self, fs: Filesystem, space: SpaceManager, rules: StepRules,
                 retired: RetiredSteps, keep: int, grace: float) -> None:
        self.fs = fs
        self.ns = fs.ns
        self.space = space
        self.rules = rules
        self.retired = retired  # its one writer
        self.keep = keep
        self.grace = grace
        self.removed_steps: list[str] = []
        self._wake = trio.Event()

    # -- events (Listener): a pass may now evict or remove more ----------------------------

    def kept(self) -> set[int]:
        """The step directories --keep-steps keeps now."""
        return step_view(self.ns, self.rules, self.keep).kept

    def sealed(self, node: Inode) -> None:
        self._wake.set()

    def persisted(self, node: Inode) -> None:
        self._wake.set()

    def copies_changed(self, node: Inode, dropped: str = "") -> None:
        self._wake.set()

    def remote_changed(self, nodes: list[Inode]) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            with trio.move_on_after(INTERVAL):
                await self._wake.wait()
            self._wake = trio.Event()
            t0 = time.monotonic()
            try:
                self.pass_once()
            except Exception:  # a bug here must not take the mount down
                log.exception("retention pass failed")
            # Coalesce bursts of seals/persists; a pass walks every file, so on a
            # large namespace it may use at most a sixth of the event loop's time.
            await trio.sleep(max(0.2, 5 * (time.monotonic() - t0)))

    def pass_once(self) -> int:
        """Evict what retention no longer keeps; returns the bytes given back."""
        space = self.space
        view = step_view(self.ns, self.rules, self.keep)
        if not view.complete:
            return 0
        kept = [d for d in view.complete if d.ino in view.kept]
        oldest_kept = min(step_number(d.name) or -1 for d in kept)
        freed = 0
        retired = set()
        for d in view.complete:
            if d.ino in view.kept or (step_number(d.name) or -1) >= oldest_kept:
                continue
            retired.add(d.ino)
            for f in files_under(self.ns, d):
                if f.persisted and space.copies.resident(f) and not space.busy(f):
                    freed += space.evict(f, "retention")
        self.retired.replace(retired)
        newest = step_number(view.complete[-1].name)
        if newest is not None:
            self._drop_stale_incomplete(newest)
        return freed

    def _drop_stale_incomplete(self, newest: int) -> None:
        """Remove incomplete steps numbered below the newest complete one: a save
        that was abandoned (the run has moved past it), once untouched for the
        grace period and with nothing open in it."""
        fs, rules = self.fs, self.rules
        root = fs.ns.inodes[ROOT]
        now = time.time_ns()
        for ino in list((root.children or {}).values()):
            d = fs.ns.get(ino)
            if d is None or not d.is_dir or rules.is_committed_step(fs.ns, d):
                continue
            if d.name.endswith(WITHDRAWN_SUFFIX.encode()):
                continue  # a withdrawn step: kept as evidence
            n = step_number(d.name)
            if n is None or n >= newest:
                continue
            files = list(files_under(fs.ns, d))
            if not files and not d.children:
                continue
            if any(f.opens or f.dirty or f.state == OPEN for f in files):
                continue
            newest_change = max([d.mtime_ns, *(f.mtime_ns for f in files),
                                 *(x.mtime_ns for x in dirs_under(fs.ns, d))])
            if (now - newest_change) / 1e9 < self.grace:
                continue
            path = fs.ns.path_of(d)
            size = sum(f.size for f in files)
            self._remove_tree(d)
            self.removed_steps.append(path)
            log.warning("removed incomplete step %s (%d files, %d bytes): older than the "
                        "newest complete step %d and unchanged for %.0f s", path, len(files),
                        size, newest, self.grace)

    def _remove_tree(self, d: Inode) -> None:
        """rm -r through the filesystem, so uploads, peers and the kernel hear of it."""
        fs = self.fs
        for child_name, child_ino in sorted((d.children or {}).items()):
            child = fs.ns.inodes[child_ino]
            if child.is_dir:
                self._remove_tree(child)
            else:
                fs.unlink(d.ino, child_name)
                fs.kernel.entry(d.ino, child_name)
        parent = fs.ns.inodes[d.parent]
        fs.rmdir(parent.ino, d.name)
        fs.kernel.entry(parent.ino, d.name)
