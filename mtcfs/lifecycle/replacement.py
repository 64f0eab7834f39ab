"""A replacement host restored before it is asked.

A host that starts under the node id of a host that held data, without that data
(a new node with an empty RAM dir, or a RAM dir that lost files), learns from its
peers' snapshot which copies the job counts on it for: the index lists this node
id as a holder of files whose data is not here ("disowned" when the snapshot was
applied). Right after start-up it pulls them into the RAM tier in the background,
as GKE's replicator restores the local checkpoint directory before the job
resumes: the files it wrote in the newest complete steps first (newest step
first, within --keep-steps), then the replicas it held, then anything else.
Each file comes through the Fetcher, striped over every live holder (or from the
bucket), so a trainer's read of a file being restored waits for that fetch
instead of starting another, and reads the file at RAM speed once it is here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from mtcfs.core.namespace import CLOSED, Inode, Namespace
from mtcfs.core.steps import StepRules, all_steps, files_under, step_number

if TYPE_CHECKING:
    from mtcfs.core.copies import Copies
    from mtcfs.fetch import Fetcher

log = logging.getLogger(__name__)


class ReplacementRestore:
    """`missing`: the files this host is listed as holding without their data (the
    peer tier collects them while it applies snapshots; empty without peers);
    `applied(what)`: returns once every live peer applied what this host published
    (the commit rule's wait), so that a restore that says it is done is counted."""

    def __init__(self, ns: Namespace, rules: StepRules, fetcher: Fetcher, copies: Copies,
                 node_id: str, keep_steps: int | None, missing: Callable[[], list[Inode]],
                 applied: Callable[[str], Awaitable[list[str]]], parallel: int = 4) -> None:
        self.ns = ns
        self.rules = rules
        self.fetcher = fetcher
        self.copies = copies
        self.node_id = node_id
        self.keep_steps = keep_steps
        self.missing = missing
        self.applied = applied
        self.parallel = parallel
        self.files: list[Inode] = []
        self.failed: dict[int, str] = {}
        self.started = 0.0  # time.monotonic() when it began; 0: never
        self.finished = 0.0
        self._done_at_start = 0

    def plan(self) -> list[Inode]:
        """What to pull, in order: this node's own files of the newest complete
        steps (newest first, at most --keep-steps of them), then its other files in
        steps (replicas it held), then the rest."""
        want = {n.ino: n for n in self.missing()
                if n.is_file and n.linked and n.state == CLOSED and not n.has_data
                and n.size > 0}
        if not want:
            return []
        steps = sorted((d for d in all_steps(self.ns, self.rules)
                        if self.rules.is_committed_step(self.ns, d)),
                       key=lambda d: (step_number(d.name) or -1, d.mtime_ns), reverse=True)
        if self.keep_steps:
            steps = steps[:self.keep_steps]
        own: list[Inode] = []
        held: list[Inode] = []
        for d in steps:
            for f in files_under(self.ns, d):
                if want.pop(f.ino, None) is not None:
                    (own if f.author == self.node_id else held).append(f)
        return own + held + sorted(want.values(), key=lambda n: n.ino)

    def plan_now(self) -> None:
        """Once, after the peer tier's start-up (its snapshot applied) and before the
        mount is live: `mtcfs prefetch --restore` finds the plan from the start."""
        self.files = self.plan()

    async def run(self) -> None:
        """Fetch what plan_now chose, `parallel` files at a time. Failures are kept
        and said; the files stay readable through the ordinary read path."""
        if not self.files:
            return
        self.started = time.monotonic()
        total = sum(n.size for n in self.files)
        log.info("background restore: %d files, %d bytes this host held before it "
                 "started (node %s), from peers or the bucket", len(self.files), total,
                 self.node_id)
        limiter = trio.CapacityLimiter(self.parallel)

        async def one(node: Inode) -> None:
            version = node.version
            await self.fetcher.fetch_ahead(node, limiter, self.failed)
            if node.ino in self.failed:
                log.warning("background restore: %s: %s", self.ns.path_of(node),
                            self.failed[node.ino])
            elif (node.linked and node.has_data and node.cached and not node.dirty
                  and node.version == version):
                # The fetch keeps what it brings as a cache copy; this one is the
                # copy the job counts on this host for (a replica, or its own).
                self.copies.restored(node)

        async with trio.open_nursery() as nursery:
            for node in self.files:
                nursery.start_soon(one, node)
                await trio.sleep(0)  # started in plan order: the newest step first
        # Its copies counted on every live host before it says it is done: announced
        # copies otherwise wait up to a second, and a host lost meanwhile takes them
        # along (its replacement would find nothing to restore).
        await self.applied("the background restore's copies")
        self.finished = time.monotonic()
        p = self.progress()
        log.info("background restore done: %d of %d files, %d bytes in %.1f s (%d failed)",
                 p["files_done"], p["files_total"], p["bytes_done"],
                 self.finished - self.started, p["failed"])

    def progress(self) -> dict[str, Any]:
        """Files and bytes planned and done, rate and ETA (`mtcfs status`, metrics)."""
        live = [n for n in self.files if n.linked]
        done = sum(self.fetcher.fetched_bytes(n) for n in live)
        total = sum(n.size for n in live)
        now = self.finished or time.monotonic()
        secs = now - self.started if self.started else 0.0
        rate = done / secs if secs > 0 else 0.0
        running = bool(self.started) and not self.finished
        return {
            "state": "running" if running else "done" if self.finished else "none",
            "files_total": len(live),
            "files_done": sum(1 for n in live if n.has_data),
            "bytes_total": total,
            "bytes_done": done,
            "failed": sum(1 for n in live if n.ino in self.failed),
            "seconds": round(secs, 3),
            "bytes_per_second": round(rate),
            "eta_seconds": round((total - done) / rate, 1) if running and rate > 0 else None,
        }

    def inos(self) -> list[int]:
        return [n.ino for n in self.files]
